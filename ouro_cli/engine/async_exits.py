"""Asynchronous scheduling of decode loops: the host reads each exit signal one loop late.

A synchronous decode step asks the device after every loop "has every row exited?"
(runner.ModelRunner._step), so the host waits for loop t to finish before it queues
loop t + 1 and the device idles for the launch latency of a whole loop (~100 kernels
per loop at Ouro-1.4B). With `LLM(..., async_scheduling=True)` loop t + 1 is queued
first, and only then does the host read the signal that loop t - 1 produced.

That is exactly the delayed exit policy of docs/model.md §3: with delay 1 a row whose
signal fires after loop t stops after loop t + 1, so "every row stops after loop t"
is already decided once loop t - 1 has been accounted (exits.ExitState: stop_after
≤ t). The flag is computed on the device after loop t - 1, copied to host memory
without blocking, and read after loop t has been queued; the step therefore breaks
at the same loop as the synchronous delayed step and computes the same bits. The
engine forces exit_mode "delayed" on threshold requests when it schedules
asynchronously, so outputs are replayable by the trainer like any delayed output
(rows with another policy would only run one masked loop more, never change).
"""

from __future__ import annotations

import torch

from .exits import ExitState


class LaggedExitProbe:
    """One decode step's "everyone stops after the next loop" flag, written after loop t
    and read by the host after loop t + 1 is queued."""

    def __init__(self) -> None:
        self._flag: torch.Tensor | None = None
        self._event = None

    def record(self, exits: ExitState, t: int) -> None:
        """After loop t: will every row have stopped once loop t + 1 ran? (not read yet)"""
        flag = (exits.stop_after <= t + 1).all()
        if flag.is_cuda:
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            flag = host
        self._flag = flag

    def everyone_done(self) -> bool:
        """The flag recorded after the previous loop (False before any was recorded)."""
        if self._flag is None:
            return False
        if self._event is not None:
            self._event.synchronize()  # waits for loop t - 1 only; loop t is already queued behind it
        return bool(self._flag)
