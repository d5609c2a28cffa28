"""Surviving an out-of-memory: ask for less, record the decision, and replay it on resume.

The memory plan (rl/sizing.py) is an upper bound by construction, but the device is not the
model: another process, allocator fragmentation or a driver's reserve can still leave a
rollout's KV cache short. A rollout that runs out of device memory while taking its cache
does not end the run. The engine gives back what it holds, the cache limit is halved (never
below one sequence: `LimitsMemory.min_kv_blocks`), and the same generate call runs again
from the start, with the same seeds; sequences that do not fit wait for a slot or are
preempted and recomputed, as with any cache smaller than a call.

A smaller cache schedules the same requests differently, which may change the sampled bits
in the default mode. So each decision is recorded: in the update's metrics line
(`memory_decisions`) and in the run's plan (`memory_decisions`: update, rank, what was
lowered, to what), written at once, not only with the next checkpoint. A resumed run reads
the decisions of its run directory and applies each from its update on (`kv_limit`), so it
repeats the recovered run bit for bit without running out of memory first.

Only what cannot run at all ends the run: a cache that cannot hold one sequence is refused
when the run is sized (rl/sizing.py), before the first update.
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
    limits = [d["kv_blocks"] for d in decisions(plan)
              if d["what"] == "kv_blocks" and d["update"] <= update and d.get("rank", 0) == rank]
    return min(limits) if limits else None


def halved(current: int, floor: int) -> int | None:
    """The next, smaller limit: half of `current`, at least `floor`; None below nothing to give."""
    if current <= floor:
        return None
    return max(floor, current // 2)


def generate_with_recovery(call: Callable[[], Any], engine: Any, *, limit: int | None, capacity: int, floor: int,
                           on_decision: Callable[[int], None]) -> Any:
    """`call()` (one generate call of `engine`), run again with a halved KV limit after each
    out-of-memory, down to `floor` blocks; `on_decision(new_limit)` records each. The last
    failure propagates (the phase reports it in one line)."""
    current = capacity if limit is None else limit
    while True:
        try:
            return call()
        except torch.OutOfMemoryError:
            smaller = halved(current, floor)
            if smaller is None or not hasattr(engine, "limit_kv_blocks"):
                raise
        engine.release_memory()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        engine.limit_kv_blocks(smaller)
        on_decision(smaller)
        current = smaller
