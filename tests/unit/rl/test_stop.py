"""Stopping on signals (ouro_cli.rl.stop): the default save rule, and first vs second signal."""

from __future__ import annotations

import os
import signal

import pytest

from ouro_cli.errors import Interrupted
from ouro_cli.rl.stop import AUTO_SAVE_WITHIN, StopSignals, wants_save


@pytest.mark.parametrize("mode, done, last, interval, updates, saves", [
    ("auto", 18, 0, 20, 80, True),     # the save at 20 is 2 updates away
    ("auto", 10, 0, 20, 80, False),    # 10 away: stop without saving
    ("auto", 20, 20, 20, 80, False),   # just saved: nothing to save
    ("auto", 77, 60, 0, 80, True),     # --save-interval 0: the final save at 80 is 3 away
    ("auto", 50, 0, 0, 80, False),
    ("on", 10, 0, 20, 80, True),
    ("on", 20, 20, 20, 80, False),
    ("off", 19, 0, 20, 80, False),
])
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
