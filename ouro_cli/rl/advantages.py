"""Group-normalised advantages: `(r − mean_group) / (std_group + 1e-6)` (docs/architecture.md §3).

std is the population standard deviation of the group (a group of equal rewards gets
zero advantage, so it contributes no gradient). No KL, no reference, no critic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EPS = 1e-6


def group_advantages(rewards: Sequence[float], group_size: int) -> list[float]:
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start:start + group_size]]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        out.extend((r - mean) / (std + EPS) for r in group)
    return out
