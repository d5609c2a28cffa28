"""bench/shapes.py's verdict: every phase of every update, and the run's final save (its COMPLETE
marker's figures, which no update's line holds), within the plan's budget."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import shapes  # noqa: E402


def update(held_train: float) -> dict:
    return {
        "update": 0,
        "k": 4,
        "step_s": 10.0,
        "rollout_s": 6.0,
        "train_s": 4.0,
        "memory_outside_gib": 2.0,
        "peak_memory_rollout_gib": 50.0,
        "peak_held_rollout_gib": 60.0,
        "peak_memory_train_gib": held_train - 5,
        "peak_held_train_gib": held_train,
    }


def final_save(held: float | None) -> dict:
    return {
        "save_s": 40.0,
        "peak_memory_save_gib": None if held is None else held - 1,
        "peak_held_save_gib": held,
        "memory_outside_gib": 2.0,
    }


@pytest.mark.parametrize(
    ("held_train", "save", "within", "save_line"),
    [
        (60.0, final_save(30.0), True, "save 29.0 (30.0)  ok"),
        (60.0, final_save(69.0), False, "save 68.0 (69.0)  OVER"),  # 69 + 2 outside > 70
        (69.0, final_save(30.0), False, "save 29.0 (30.0)  ok"),  # the train phase over, the save within
        (60.0, final_save(None), True, None),  # a CPU run: no peaks, no save line
        (60.0, None, True, None),  # no COMPLETE marker: the run did not finish
    ],
)
def test_the_final_save_counts_toward_the_verdict(held_train, save, within, save_line):
    result = {"budget_gib": 70.0, "updates": [update(held_train)], "final_save": save}
    held, lines = shapes.verdict(result)
    assert held is within
    assert lines[0].endswith("OVER in train") is (held_train + 2.0 > 70.0)
    if save_line is None:
        assert len(lines) == 1
    else:
        assert lines[1:] == [f"  final save: 40.0 s; peak GiB (held) + 2.0 outside, budget 70.0: {save_line}"]
