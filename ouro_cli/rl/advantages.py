"""Advantages from a group's rewards, and the reward-side shaping that comes before them.

`--advantage` picks the estimator; each sees one group (the `group_size` samples of one
prompt) at a time (docs/grpo.md):

    grpo     A_i = (r_i − mean) / (std + 1e-6)       population std (docs/architecture.md §3)
    dr-grpo  A_i = r_i − mean                         Dr. GRPO: no std; the job pairs it with the
                                                      constant-length loss (trainer aggregation)
    rloo     A_i = r_i − mean_{j≠i} r_j               leave-one-out baseline (= G/(G−1) · (r_i − mean))

A group of equal rewards gets zero advantage under all three, so it contributes no
gradient (`--filter-groups` drops such groups instead: `zero_variance`). No KL, no
reference, no critic.

`length_penalty` is DAPO's soft overlong punishment (`--overlong soft`): 0 up to
L_max − buffer tokens, then falling linearly to −1 at L_max, added to the raw reward
before the advantages are taken. Filtering looks at the raw reward only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EPS = 1e-6
ESTIMATORS = ("grpo", "dr-grpo", "rloo")


def group_advantages(rewards: Sequence[float], group_size: int, estimator: str = "grpo") -> list[float]:
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start : start + group_size]]
        n = len(group)
        mean = sum(group) / n
        if estimator == "grpo":
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / n)
            out.extend((r - mean) / (std + EPS) for r in group)
        elif estimator == "dr-grpo":
            out.extend(r - mean for r in group)
        else:
            total = sum(group)
            out.extend(r - (total - r) / (n - 1) for r in group)
    return out


def zero_variance(rewards: Sequence[float]) -> bool:
    """A group whose rewards are all equal (its variance is 0, whatever their mean): no signal."""
    return all(r == rewards[0] for r in rewards)


def length_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong penalty of a response of `length` tokens (at most `max_length`)."""
    start = max_length - buffer
    if length <= start:
        return 0.0
    return max(-1.0, (start - length) / buffer)
