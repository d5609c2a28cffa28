"""The loop's guard after the train step (rl/loop.py check_step): a skipped step or a
non-finite loss or gradient norm stops the run before anything is published or saved; an
update that had nothing to train (every group filtered) took no step and passes."""

from __future__ import annotations

import math

import pytest

from ouro_cli.errors import CheckFailed
from ouro_cli.rl.loop import check_step


@pytest.mark.parametrize(
    "train, last, shown",
    [
        (
            {"loss": math.nan, "grad_norm": math.nan, "step_applied": False},
            2,
            r"the loss \(nan\) or the gradient norm \(nan\) is not finite; .*keeps its checkpoint at update 2\)",
        ),
        (
            {"loss": math.inf, "grad_norm": 0.5, "step_applied": True},
            0,
            r"the loss \(inf\) or the gradient norm \(0.5\) is not finite; .*keeps no checkpoint yet\)",
        ),
        (
            {"loss": math.nan, "grad_norm": 0.5, "step_applied": True, "step_losses": [0.2, math.nan]},
            0,
            r"the loss \(nan\) or the gradient norm \(0.5\) is not finite; .*keeps no checkpoint yet\)",
        ),  # step 2 of 2
    ],
)
def test_a_non_finite_step_stops_the_run(train, last, shown):
    check_step(3, {"loss": 0.1, "grad_norm": 1.0, "step_applied": True}, last)  # a finite step passes
    with pytest.raises(CheckFailed, match=f"^update 3: {shown}. Check the reward function, the data and --lr$"):
        check_step(3, train, last)


def test_an_update_without_steps_passes():
    check_step(3, {"loss": None, "grad_norm": None, "step_applied": True, "step_losses": []}, 0)
