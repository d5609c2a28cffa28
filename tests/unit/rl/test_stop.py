"""Stopping on signals (ouro_cli.rl.stop): the default save rule, and first vs second signal."""

from __future__ import annotations

import os
import signal

import pytest

from ouro_cli.errors import Interrupted
from ouro_cli.rl.stop import AUTO_SAVE_WITHIN, StopSignals, wants_save


@pytest.mark.parametrize(
    "mode, done, last, interval, updates, saves",
    [
        ("auto", 18, 0, 20, 80, True),  # the save at 20 is 2 updates away
        ("auto", 10, 0, 20, 80, False),  # 10 away: stop without saving
        ("auto", 20, 20, 20, 80, False),  # just saved: nothing to save
        ("auto", 77, 60, 0, 80, True),  # --save-interval 0: the final save at 80 is 3 away
        ("auto", 50, 0, 0, 80, False),
        ("on", 10, 0, 20, 80, True),
        ("on", 20, 20, 20, 80, False),
        ("off", 19, 0, 20, 80, False),
    ],
)
def test_when_a_stop_saves(mode, done, last, interval, updates, saves):
    assert AUTO_SAVE_WITHIN == 3
    assert wants_save(mode, done=done, last_checkpoint=last, save_interval=interval, updates=updates) is saves


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_first_signal_is_noted_and_a_second_stops_at_once(sig, code):
    notes = []
    previous = signal.getsignal(sig)
    with StopSignals(notes.append, "ouro resume RUN --updates 9") as stop:
        os.kill(os.getpid(), sig)
        assert stop.signum == sig and "stopping after the current update" in notes[0]
        with pytest.raises(Interrupted, match="stopped at once by a second .*ouro resume RUN --updates 9") as err:
            os.kill(os.getpid(), sig)
        assert err.value.exit_code == code
    assert signal.getsignal(sig) is previous


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_before_the_first_update_the_first_signal_stops_at_once(sig, code):
    """Setup and the initial evaluation have nothing to finish: no waiting for them."""
    notes = []
    at_once = "before its first update (no checkpoint yet: the resume starts it again)"
    with StopSignals(notes.append, "ouro resume RUN --updates 9", at_once=at_once) as stop:
        with pytest.raises(Interrupted) as err:
            os.kill(os.getpid(), sig)
        assert str(err.value) == (
            f"stopped by {signal.Signals(sig).name} before its first update (no checkpoint yet: "
            "the resume starts it again); continue with: ouro resume RUN --updates 9"
        )
        assert err.value.exit_code == code and notes == []
        stop.begin_updates()
        os.kill(os.getpid(), sig)  # from the first update on: noted, the update finishes
        assert stop.signum == sig and "stopping after the current update" in notes[0]


@pytest.mark.parametrize(
    "last, state",
    [
        (0, "no checkpoint yet: the resume starts it again"),
        (4, "its checkpoint is at update 4"),
    ],
)
def test_a_stop_before_an_update_says_whether_a_checkpoint_exists(last, state):
    from types import SimpleNamespace

    from ouro_cli.rl.loop import _stop_if_asked

    session = SimpleNamespace(
        plan={"next_update": last},
        is_main=True,
        options=SimpleNamespace(save_on_interrupt="auto", save_interval=0, updates=80),
    )
    with pytest.raises(Interrupted) as err:
        _stop_if_asked(session, SimpleNamespace(signum=signal.SIGTERM), last, "ouro resume RUN --updates 80")
    where = f"after update {last - 1}" if last else "before its first update"
    assert str(err.value) == f"stopped by SIGTERM {where} ({state}); continue with: ouro resume RUN --updates 80"
