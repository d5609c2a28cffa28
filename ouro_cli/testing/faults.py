"""Test-only fault injection: a process signals itself at a named point of a run.

The kill-test harness (tests/integration/test_kill_resume.py) must interrupt a run at exact
places, not at a time that may fall anywhere. Code that has such a place calls
`point(name)`; nothing happens unless the environment variable `OURO_TEST_FAULT` names
it. This module is the only reader of that variable, and no user-facing behaviour
depends on it: it exists for the tests, like `--test-break-resume`.

    OURO_TEST_FAULT="POINT[@N]=SIGNAL[+SIGNAL...]"

sends the signals, in order, to this process the N-th time (default 1) it reaches POINT.
`rollout@3=TERM` sends SIGTERM at the end of the third update's rollout; `save.renamed=KILL`
SIGKILLs the first save between the rename of its iteration and the tracker write;
`rollout@2=INT+INT` sends two SIGINTs at once (the second one stops at once).

Points: `rollout` (the engine has sampled, nothing has trained), `save.staged` (a save has
written every file of `iter_N.staging/`, nothing is committed), `save.renamed` (`iter_N/` is
complete and in place, the tracker still names the previous iteration, or nothing for a
first save), `save.tracker` (the tracker names `iter_N`; older iterations not yet pruned).
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "OURO_TEST_FAULT"
POINTS = ("rollout", "save.staged", "save.renamed", "save.tracker")


def _parse(spec: str | None) -> tuple[str, int, list[signal.Signals]] | None:
    if not spec:
        return None
    where, _, what = spec.partition("=")
    name, _, hit = where.partition("@")
    if name not in POINTS or not what:
        raise ValueError(f"{ENV}={spec!r}: expected POINT[@N]=SIGNAL[+SIGNAL], POINT one of {', '.join(POINTS)}")
    return name, int(hit or 1), [signal.Signals[f"SIG{s.strip().upper()}"] for s in what.split("+")]


_FAULT = _parse(os.environ.get(ENV))
_reached: Counter[str] = Counter()


def point(name: str) -> None:
    """A place where the harness may stop this process; a no-op in every real run."""
    if _FAULT is None or _FAULT[0] != name:
        return
    _reached[name] += 1
    if _reached[name] == _FAULT[1]:
        for sig in _FAULT[2]:
            os.kill(os.getpid(), sig)
