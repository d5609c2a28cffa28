"""`--exact` is part of a run's contract (what the kernels resolve to, `execution`): a resume
that would turn it on or off is refused naming it, and so is a plan that does not record it."""

from __future__ import annotations

import pytest

from ouro_cli.config import build
from ouro_cli.errors import UserError
from ouro_cli.rl import plan as plans
from ouro_cli.rl.options import TrainOptions


def contract(**options):
    return plans.build_contract(
        build(TrainOptions, {"device": "cpu", **options}),
        data_sha256="d" * 64,
        model_config={"x": 1},
        tokenizer_sha256=None,
        template={"name": "chatml"},
        num_loops=4,
    )


def test_exact_is_recorded_and_a_change_is_refused_naming_it():
    plain, exact = contract(), contract(exact=True)
    assert plain["execution"]["exact"] == "off" and exact["execution"]["exact"] == "on"
    assert exact["execution"]["replay_attention"] == "exact"
    plans.check_same_contract(exact, contract(exact=True), allow_scheduler=False)
    with pytest.raises(
        UserError,
        match=r"^resume would change execution.exact: the run has 'off', this invocation "
        r"'on' \(set by --exact; resume with the run's\)",
    ):
        plans.check_same_contract(plain, exact, allow_scheduler=False)


def test_a_plan_without_exact_is_refused_naming_it():
    old = contract()
    old["execution"] = {k: v for k, v in old["execution"].items() if k != "exact"}
    with pytest.raises(UserError, match="^resume would change execution.exact: the run has None"):
        plans.check_same_contract(old, contract(), allow_scheduler=False)
