"""Which groups an update trains on, and how they are cut into optimizer steps (docs/grpo.md).

A group is one prompt's `--group-size` samples; it is named by its *position*, its place
in the order the update drew its prompts (0 … P−1 for the first `--prompts-per-update`
prompts, then on through refill rounds). Positions pick the request seeds and the rank
that samples a group, so everything here is a function of positions and rewards only:
the same on every rank, for any rank count, and again on a resume.

- `--filter-groups` (DAPO dynamic sampling): a group whose raw rewards are all equal has
  zero variance and carries no signal; it is dropped, and refill rounds draw more prompts
  from the data cursor until P groups with signal are found or the refill budget is spent
  (`refill_size`). The first P such groups in position order are trained (`first_groups`);
  any beyond them were drawn but are not trained.
- `--mini-batches N`: the trained groups, in position order, are cut into N contiguous
  runs of whole groups whose sizes differ by at most one (`split_groups`). Whole groups
  keep each step's advantages centred the way the estimator centred them; with fewer
  groups than N, the last mini-batches are empty (no step; the LR schedule still moves).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def refill_size(*, wanted: int, kept: int, drawn: int, budget_left: int, per_round: int) -> int:
    """Prompts the next refill round draws: the shortfall `wanted − kept`, scaled by how many
    draws each kept group has cost so far (so one round usually suffices), at most
    `per_round` (the engine's sizing holds one update's batch) and the budget left."""
    short = wanted - kept
    if short <= 0 or budget_left <= 0:
        return 0
    expected = math.ceil(short * drawn / kept) if kept else per_round
    return min(budget_left, per_round, max(short, expected))


def first_groups(flags: Sequence[tuple[int, bool]], wanted: int) -> list[int]:
    """Positions of the first `wanted` groups (by position) whose flag says they carry signal."""
    return [position for position, signal in sorted(flags) if signal][:wanted]


def split_groups(positions: Sequence[int], n: int) -> list[list[int]]:
    """`positions` (in order) cut into `n` contiguous runs, sizes differing by at most one,
    larger ones first; runs are empty when there are fewer positions than `n`."""
    size, extra = divmod(len(positions), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(list(positions[start:end]))
        start = end
    return out
