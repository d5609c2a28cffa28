"""`--reward-timeout`: a reward call that runs past its limit is stopped, and the run with it.

A watchdog thread waits beside the call. When the call outlives its limit, the watchdog
marks it and sends `SIGNAL` to the main thread, whose handler raises `RewardTimeout`
inside the call: a sleep or a wait returns early, Python code stops at its next line.
`RewardTimeout` is a BaseException, so a reward's `except Exception` does not take it.
A call that swallows it anyway, or runs outside the main thread (where no handler can be
installed), is reported once it returns: `fired` says the limit passed. A call that
returns in time is never touched, so the limit changes no reward.

The limit has a signal of its own: SIGALRM is the math grader's (rewards/math_grader.py
`time_budget`, which steps aside when an interval timer already runs).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

SIGNAL = signal.SIGUSR1


class RewardTimeout(BaseException):
    """Raised inside a reward call that ran past its limit."""


@dataclass
class Limit:
    seconds: float | None
    fired: bool = False  # the limit passed while the call ran
    active: bool = True  # the call runs: a late signal after it returned raises nothing


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[Limit]:
    """Raise `RewardTimeout` in the block once it has run `seconds` (None: no limit); the
    yielded `Limit` says whether it fired."""
    limit = Limit(seconds)
    if seconds is None:
        yield limit
        return
    in_main = threading.current_thread() is threading.main_thread()
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            limit.fired = True
            if in_main:
                signal.pthread_kill(threading.main_thread().ident, SIGNAL)

    def stop(signum: int, frame) -> None:
        if limit.active:
            raise RewardTimeout()

    previous = signal.signal(SIGNAL, stop) if in_main else None
    watchdog = threading.Thread(target=watch, name="reward-timeout", daemon=True)
    watchdog.start()
    try:
        yield limit
    finally:
        limit.active = False
        done.set()
        watchdog.join()  # a signal it sent has reached this thread before the handler goes
        if in_main:
            signal.signal(SIGNAL, previous)
