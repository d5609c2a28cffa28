"""The GRPO options of issue 27 on the job's side, by hand: advantage estimators, the overlong
penalty, which groups are filtered and trained, how they are cut into mini-batches, how the LR
schedule is counted in optimizer steps; and every option is in the plan's contract, so that a
resume refuses to change it, naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ouro_cli.config import build
from ouro_cli.errors import UserError
from ouro_cli.rl import plan as plans
from ouro_cli.rl.advantages import group_advantages, length_penalty, zero_variance
from ouro_cli.rl.groups import first_groups, refill_size, split_groups
from ouro_cli.rl.options import TrainOptions


def test_advantage_estimators_by_hand():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]  # two groups of 4; the second all equal
    half = 0.5 / (0.5 + 1e-6)  # mean 0.5, population std 0.5
    assert group_advantages(rewards, 4) == pytest.approx([half, -half, -half, half, 0, 0, 0, 0], rel=1e-12)
    assert group_advantages(rewards, 4, "dr-grpo") == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    # leave-one-out: 1 − (0 + 0 + 1) / 3 and 0 − (1 + 0 + 1) / 3
    assert group_advantages(rewards, 4, "rloo") == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
    assert group_advantages([3.0, 1.0], 2, "rloo") == [2.0, -2.0]
    with pytest.raises(ValueError):
        group_advantages(rewards, 4, "ppo")


def test_groups_are_filtered_by_variance_not_by_mean():
    assert zero_variance([1.0, 1.0, 1.0]) and zero_variance([0.0, 0.0, 0.0]) and zero_variance([0.5, 0.5])
    assert not zero_variance([0.0, 1.0]) and not zero_variance([1.0, 1.0, 0.9])  # mean 0.5 or 0.97: signal


def test_soft_overlong_penalty_by_hand():
    # L_max 10, buffer 4: free up to 6 tokens, then −1/4 per token, −1 at 10
    assert [length_penalty(n, 10, 4) for n in (1, 6, 7, 8, 9, 10)] == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert length_penalty(10, 10, 10) == -1.0 and length_penalty(1, 10, 10) == -0.1


def test_refill_sizes_and_the_trained_groups():
    # 16 wanted, 12 kept of 16 drawn: 4 short at 4/3 draws per kept group -> 6
    assert refill_size(wanted=16, kept=12, drawn=16, budget_left=64, per_round=16) == 6
    assert refill_size(wanted=16, kept=0, drawn=16, budget_left=64, per_round=16) == 16  # no rate yet: a full round
    assert refill_size(wanted=16, kept=12, drawn=16, budget_left=5, per_round=16) == 5  # the budget caps it
    assert refill_size(wanted=16, kept=2, drawn=16, budget_left=64, per_round=16) == 16  # at most one update's batch
    assert refill_size(wanted=16, kept=16, drawn=20, budget_left=64, per_round=16) == 0
    assert refill_size(wanted=16, kept=15, drawn=16, budget_left=0, per_round=16) == 0
    flags = [(3, True), (0, False), (1, True), (5, True), (2, True), (4, False)]
    assert first_groups(flags, 3) == [1, 2, 3] and first_groups(flags, 9) == [1, 2, 3, 5]


def test_mini_batches_are_contiguous_runs_of_whole_groups():
    assert split_groups([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_groups([1, 4, 6, 7, 9, 12, 13], 3) == [[1, 4, 6], [7, 9], [12, 13]]
    assert split_groups([2], 3) == [[2], [], []]
    assert split_groups(list(range(8)), 1) == [list(range(8))]


def options(**values):
    return build(TrainOptions, values)


def test_the_lr_schedule_counts_optimizer_steps():
    from ouro_cli.rl.loop import _trainer_config

    sizing = SimpleNamespace(
        max_tokens_per_micro_batch=1024,
        recompute=False,
        offload_optimizer=False,
        token_cost=None,
        prompt_heads=False,
        deep_parts_first=True,
    )
    plain = _trainer_config(options(updates=10, lr_schedule="cosine", warmup_steps=2), sizing)
    assert (plain.warmup_steps, plain.decay_steps, plain.aggregation) == (2, 10, "token_mean")
    config = _trainer_config(
        options(updates=10, lr_schedule="cosine", warmup_steps=2, mini_batches=2, epochs=3), sizing
    )
    assert (config.warmup_steps, config.decay_steps) == (12, 60)  # --warmup-steps counts updates
    constant = _trainer_config(options(updates=10, warmup_steps=1, mini_batches=4), sizing)
    assert (constant.warmup_steps, constant.decay_steps) == (4, None)
    dr = _trainer_config(options(advantage="dr-grpo", max_response_len=32), sizing)
    assert (dr.aggregation, dr.aggregation_length) == ("constant_length", 32)
    chosen = _trainer_config(options(advantage="dr-grpo", aggregation="token_mean"), sizing)
    assert chosen.aggregation == "token_mean"  # an explicit aggregation is kept


def contract(**values):
    return plans.build_contract(
        options(**values),
        data_sha256="d" * 64,
        model_config={"x": 1},
        tokenizer_sha256=None,
        template={"name": "chatml"},
        num_loops=4,
    )


BASE = dict(filter_groups=True, max_refill=8, overlong="soft", overlong_buffer=4)
CHANGES = [
    ("mini_batches", 2),
    ("epochs", 2),
    ("filter_groups", False),
    ("max_refill", 3),
    ("overlong", "mask"),
    ("overlong_buffer", 6),
    ("advantage", "rloo"),
    ("loop_weighting", "exit-pdf"),
    ("loop_weight_alpha", 2.0),
    ("aggregation", "constant_length"),
    ("is_correction", "tis"),
    ("clip_ratio_c", 3.0),
    ("log_ratio_bound", 10.0),
]


@pytest.mark.parametrize("key, value", CHANGES)
def test_every_option_is_in_the_contract_and_a_resume_may_not_change_it(key, value):
    saved = contract(**BASE)
    assert saved[key] == options(**BASE).to_dict()[key]
    with pytest.raises(UserError, match=f"^resume would change {key}: "):
        plans.check_same_contract(saved, contract(**{**BASE, key: value}), allow_scheduler=False)


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(mini_batches=0), "--mini-batches must be at least 1"),
        (dict(epochs=0), "--epochs must be at least 1"),
        (dict(prompts_per_update=4, mini_batches=5), "--mini-batches 5 is more than the 4 prompts"),
        (dict(max_refill=4), "--max-refill is the budget of --filter-groups"),
        (dict(filter_groups=True, max_refill=-1), "--max-refill must be at least 0"),
        (dict(overlong_buffer=4), "--overlong-buffer is the penalty buffer of --overlong soft"),
        (dict(overlong="soft", overlong_buffer=100, max_response_len=48), "--overlong-buffer 100 is more than"),
        (dict(advantage="ppo"), "--advantage must be one of grpo, dr-grpo, rloo"),
        (dict(overlong="clip"), "--overlong must be one of none, mask, soft"),
        (dict(loop_weighting="last"), "--loop-weighting must be one of exit, uniform, progressive, exit-pdf"),
    ],
)
def test_bad_values_are_one_line_naming_the_flag(values, message):
    with pytest.raises(UserError, match=message):
        build(TrainOptions, values, check=False).validate()


def test_defaults_and_the_budgets_they_stand_for():
    o = TrainOptions()
    assert (o.mini_batches, o.epochs, o.filter_groups, o.overlong, o.advantage) == (1, 1, False, "none", "grpo")
    assert o.refill_budget == 0 and o.optimizer_steps_per_update == 1 and o.length_buffer == 12
    assert options(filter_groups=True, prompts_per_update=5).refill_budget == 20
    assert options(filter_groups=True, max_refill=3).refill_budget == 3
    assert options(overlong="soft", overlong_buffer=5).length_buffer == 5


def test_trackers_get_the_per_loop_logprobs_one_curve_per_loop():
    from ouro_cli.rl.loggers import scalars

    out = scalars({"update": 3, "k": 2, "train_loop_logprob_mean": [-1.5, -1.25, None, None], "groups_trained": 4})
    assert out["train_loop_logprob_mean/t=1"] == -1.5 and out["train_loop_logprob_mean/t=2"] == -1.25
    assert "train_loop_logprob_mean/t=3" not in out and out["groups_trained"] == 4.0
