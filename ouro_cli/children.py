"""Processes forked by this one die with it.

megatron-core's checkpoint writer (and its async saver) forks helper processes that wait
for work; when an `ouro` command is killed (SIGKILL, the OOM killer) they would outlive it,
idle, holding the command's stdout and stderr open. After every `os.fork` in this process
the child asks the kernel for SIGKILL when its parent dies (Linux `PR_SET_PDEATHSIG`).
Programs started with `subprocess` (a fork followed by exec, without Python's fork hooks)
are not affected: the commands verify-resume runs end on their own terms.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_installed = False
_parent = [0]


def _remember_parent() -> None:
    _parent[0] = os.getpid()


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux, or no prctl: children may outlive a killed parent
        return
    if os.getppid() != _parent[0]:  # the parent died between the fork and the prctl
        os._exit(1)


def die_with_this_process() -> None:
    """Install the fork hook once per process (a no-op off Linux)."""
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_remember_parent, after_in_child=_die_with_parent)
    _installed = True
