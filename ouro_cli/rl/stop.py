"""Stopping a run on SIGTERM or SIGINT: at the next safe point, or at once on a second signal.

Before the run's first update (setup, the initial evaluation) there is nothing to finish:
a signal stops it at once, saying where the run stands (`at_once`). From the first
update on, the first signal is noted and the update in progress runs to its end (its records
written, its scheduled save done); between updates the loop then stops, saving a
checkpoint first when `--save-on-interrupt` says so, and ends with `Interrupted` (exit
130 for SIGINT, 143 for SIGTERM) whose one line says how to continue. A second signal
raises `Interrupted` at once, wherever the process is. Either way the run directory
stays consistent, because nothing on it is ever half-committed: a checkpoint becomes
visible by a rename and a tracker write (checkpoint/layout.py), and an update's records
are on disk before the save that includes it starts (records.py).

`--save-on-interrupt on` saves unsaved updates, `off` never does; `auto` (the default)
saves when the next scheduled checkpoint is at most `AUTO_SAVE_WITHIN` updates away (the
run was about to pay for that save anyway). Further from a save it stops without one, so a
scheduler's short SIGTERM grace period is kept, and the resume repeats the updates since
the last checkpoint, bit for bit.

Under torchrun the ranks agree on stopping (`any` over ranks, once per update), so they
stop after the same update.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from ouro_cli.errors import Interrupted

AUTO_SAVE_WITHIN = 3
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def wants_save(mode: str, *, done: int, last_checkpoint: int, save_interval: int, updates: int) -> bool:
    """Whether a run stopped after `done` updates saves first (`mode`: auto, on or off)."""
    if done <= last_checkpoint or mode == "off":
        return False
    if mode == "on":
        return True
    next_save = min(updates, (done // save_interval + 1) * save_interval) if save_interval else updates
    return next_save - done <= AUTO_SAVE_WITHIN


class StopSignals:
    """Within the block, SIGINT and SIGTERM set `signum` (the first) or raise `Interrupted`
    (a second one); while `at_once` is set (where the run stands, before its updates begin)
    the first one raises it at once. The previous handlers are restored on exit. Outside
    the main thread it installs nothing (signals are delivered to the main thread only)."""

    def __init__(self, log: Callable[[str], None], hint: str, at_once: str | None = None) -> None:
        self.log = log
        self.hint = hint  # how to continue the run
        self.at_once = at_once
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def begin_updates(self) -> None:
        """From here on a first signal lets the update in progress finish."""
        self.at_once = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.at_once is not None:
            raise Interrupted(f"stopped by {signal_name(signum)} {self.at_once}; continue with: {self.hint}", signum)
        if self.signum is None:
            self.signum = signum
            self.log(
                f"{signal.Signals(signum).name}: stopping after the current update (send it again to stop at once)"
            )
            return
        raise Interrupted(
            f"stopped at once by a second {signal_name(signum)}: the run keeps its last checkpoint and "
            f"the records up to it; continue with: {self.hint}",
            signum,
        )


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
