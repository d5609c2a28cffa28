"""Surviving an out-of-memory: ask for less, record the decision, and replay it on resume.

The memory plan (rl/sizing.py) is an upper bound by construction, but the device is not the
model: another process, allocator fragmentation or a driver's reserve can still leave a
rollout's KV cache or a train step's activations short. Neither ends the run:

- A rollout that runs out of device memory while taking its cache: the engine gives back
  what it holds, the cache limit is halved (never below one sequence:
  `LimitsMemory.min_kv_blocks`), and the same generate call runs again from the start, with
  the same seeds; sequences that do not fit wait for a slot or are preempted and
  recomputed, as with any cache smaller than a call.
- A train step that runs out of memory in the forward or backward pass of a micro-batch:
  the failed attempt's activations are dropped and its partial gradients zeroed
  (`Trainer.discard_step`), the token limit per micro-batch is halved (never below the
  longest sample the run can hold, the floor its plan keeps too), and the same step's
  samples, cut again, run from the step's start. The optimizer has not stepped (it steps
  after the last backward), and the update's earlier steps stay. A first step that also
  computes the first policy's logprobs (--is-correction) computes them again at the new
  limit, as its own forward then does.

A smaller cache schedules the same requests differently, and other micro-batches sum the same
gradient in another order, either of which may change the bits. So each decision is recorded:
in the update's metrics line (`memory_decisions`) and in the run's plan (`memory_decisions`:
update, rank, phase, the train step's index in the update, what was lowered, to what), written
at once, not only with the next checkpoint. A lowered limit holds for the rest of the run. A
resumed run reads the decisions of its run directory and applies each from its point on
(`kv_limit` from its update, `micro_batch_limit` from its update and step), so it repeats the
recovered run bit for bit without running out of memory first.

Only what cannot run at all ends the run: a cache that cannot hold one sequence is refused
when the run is sized (rl/sizing.py), before the first update; an out-of-memory at the floor
is reported in one line by its phase (rl/phases.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

KEY = "memory_decisions"


def decisions(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's recorded decisions, in order."""
    return list(plan.get(KEY) or [])


def merged(*plans: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The decisions of several copies of one run's plan (a checkpoint's and the run
    directory's, which may have recorded later ones), each once, by update."""
    seen: dict[str, dict[str, Any]] = {}
    for plan in plans:
        for d in decisions(plan or {}):
            seen.setdefault(repr(sorted(d.items())), d)
    return sorted(seen.values(), key=lambda d: (d["update"], d.get("rank", 0)))


def kv_limit(plan: dict[str, Any], update: int, rank: int) -> int | None:
    """The KV blocks (at T planes) rank `rank`'s rollouts may take at `update`: the lowest
    limit decided at or before it, or None (no limit)."""
    limits = [
        d["kv_blocks"]
        for d in decisions(plan)
        if d["what"] == "kv_blocks" and d["update"] <= update and d.get("rank", 0) == rank
    ]
    return min(limits) if limits else None


def halved(current: int, floor: int) -> int | None:
    """The next, smaller limit: half of `current`, at least `floor`; None below nothing to give."""
    if current <= floor:
        return None
    return max(floor, current // 2)


def generate_with_recovery(
    call: Callable[[], Any],
    engine: Any,
    *,
    limit: int | None,
    capacity: int,
    floor: int,
    on_decision: Callable[[int], None],
) -> Any:
    """`call()` (one generate call of `engine`), run again with a halved KV limit after each
    out-of-memory, down to `floor` blocks; `on_decision(new_limit)` records each. The last
    failure propagates (the phase reports it in one line)."""
    return _halving(
        call,
        capacity if limit is None else limit,
        floor,
        release=engine.release_memory,
        lower=engine.limit_kv_blocks,
        on_decision=on_decision,
    )


def micro_batch_limit(plan: dict[str, Any], update: int, step: int, rank: int) -> int | None:
    """The tokens per micro-batch rank `rank`'s train step `step` of `update` may take: the
    lowest limit decided at or before that step, or None (the memory plan's)."""
    limits = [
        d["max_tokens_per_micro_batch"]
        for d in decisions(plan)
        if d["what"] == "max_tokens_per_micro_batch"
        and (d["update"], d["step"]) <= (update, step)
        and d.get("rank", 0) == rank
    ]
    return min(limits) if limits else None


def train_step_with_recovery(
    attempt: Callable[[], Any], trainer: Any, *, floor: int, on_decision: Callable[[int], None]
) -> Any:
    """`attempt()` (a train step's forward and backward passes on this rank, its micro-batches
    cut at `trainer.micro_batch_tokens`), run again from zeroed gradients with that limit halved
    after each out-of-memory, down to `floor` tokens; `on_decision(new_limit)` records each. The
    last failure propagates (the phase reports it in one line)."""
    return _halving(
        attempt,
        trainer.micro_batch_tokens,
        floor,
        release=trainer.discard_step,
        lower=trainer.limit_micro_batch_tokens,
        on_decision=on_decision,
    )


def _halving(
    call: Callable[[], Any],
    limit: int | None,
    floor: int,
    *,
    release: Callable[[], None],
    lower: Callable[[int], None],
    on_decision: Callable[[int], None],
) -> Any:
    """`call()`, run again after each out-of-memory once `release()` gave back what the failed
    call held and `lower(n)` set the halved limit. The retry runs outside the `except` block:
    the failed call's frames, and the tensors they hold, are gone by then."""
    while True:
        try:
            return call()
        except torch.OutOfMemoryError:
            smaller = None if limit is None else halved(limit, floor)
            if smaller is None:
                raise
        release()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        lower(smaller)
        on_decision(smaller)
        limit = smaller
