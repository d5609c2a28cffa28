"""Packing layout, replay depths, loss weights, the clipped surrogate and config validation
(no Megatron, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from ouro_cli.errors import UserError
from ouro_cli.model.ouro import positions_per_loop
from ouro_cli.trainer.batching import (
    Sample,
    TokenCost,
    WorkCounter,
    build_micro_batch,
    loss_weights,
    plan_micro_batches,
)
from ouro_cli.trainer.config import TrainerConfig
from ouro_cli.trainer.loss import clipped_surrogate, entropy, token_logprobs

T = 4


def sample(m, n, adv=1.0, depth=2):
    return Sample(list(range(10, 10 + m)), list(range(50, 50 + n)), [T] + [depth] * (n - 1), [-1.0] * n, adv)


def test_depth_vector_follows_the_replay_contract():
    s = Sample([1, 2, 3], [7, 8, 9], [4, 2, 3], [-1.0] * 3, 0.5)
    assert s.depths(T) == [4, 4, 4, 2, 3, 4]  # [T]*m + exit_depths[1:] + [T]


def test_packed_rows_restart_documents_and_score_the_right_positions():
    samples = [sample(2, 3), sample(3, 2), sample(1, 4)]  # lengths 5, 5, 5
    w = loss_weights(samples, "token_mean", global_tokens=9, global_samples=3)
    (rows,) = plan_micro_batches(samples, pack=True, pack_length=10)
    assert rows == [[0, 1], [2]]  # first fit: [s0, s1] then [s2] padded
    mb = build_micro_batch(samples, w, T, rows=rows)
    assert mb.input_ids.shape == (2, 10)
    assert mb.document_ids[0].tolist() == [0] * 5 + [1] * 5
    assert mb.attention_mask[1].tolist() == [True] * 5 + [False] * 5
    # s1 starts at column 5 with prompt length 3: its first response token is scored at column 7.
    assert mb.score_rows.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert mb.score_cols.tolist() == [1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert mb.targets.tolist() == [50, 51, 52, 50, 51, 50, 51, 52, 53]
    assert mb.depths[0].tolist() == [4, 4, 2, 2, 4, 4, 4, 4, 2, 4]
    assert mb.weights.sum().item() == pytest.approx(1.0)
    work = WorkCounter()
    work.add_micro_batch(mb, num_layers=2, recompute=True)
    assert work.required == 2 * int(mb.depths[mb.attention_mask].sum()) == 2 * 48
    # a quarter of the positions is padding and half the rest stops at depth 2, so every loop
    # runs only its positions (model/ouro.py GATHER_BELOW): exactly the work required
    assert work.executed == work.required and work.recomputed == work.executed
    assert work.tokens == 15 and work.padded_tokens == 20


def test_unpacked_rows_are_padded_without_document_ids():
    samples = [sample(2, 3), sample(1, 1)]
    (rows,) = plan_micro_batches(samples, pack=False)
    mb = build_micro_batch(samples, [[0.25] * 3, [0.25]], T, rows=rows)
    assert rows == [[0], [1]] and mb.input_ids.shape == (2, 5) and mb.document_ids is None
    assert mb.attention_mask[1].tolist() == [True, True, False, False, False]


def test_too_long_sample_for_pack_length_is_a_user_error():
    with pytest.raises(UserError, match="pack_length"):
        plan_micro_batches([sample(8, 8)], pack=True, pack_length=10)
    with pytest.raises(UserError, match="--max-tokens-per-micro-batch"):
        plan_micro_batches([sample(8, 8)], max_tokens=12)


def test_sequence_mean_weights():
    samples = [sample(1, 2), sample(1, 4)]
    w = loss_weights(samples, "sequence_mean", global_tokens=6, global_samples=4)
    assert w == [[1 / 8] * 2, [1 / 16] * 4]


def test_micro_batches_by_count_and_by_token_budget():
    five = [sample(2, 3) for _ in range(5)]  # 5 tokens each
    assert plan_micro_batches(five, micro_batch_size=2, pack=False) == [[[0], [1]], [[2], [3]], [[4]]]
    assert plan_micro_batches(five, pack=False) == [[[0], [1], [2], [3], [4]]]
    # rows of 10 tokens hold two samples; a budget of 20 positions holds two rows
    assert plan_micro_batches(five, max_tokens=20, pack_length=10) == [[[0, 1], [2, 3]], [[4]]]
    # default capacity (the longest sample, 5): one sample per row, four rows per 20 positions
    assert plan_micro_batches(five, max_tokens=20) == [[[0], [1], [2], [3]], [[4]]]
    # a sample that fits an open row joins it without counting against the budget
    mixed = [sample(2, 6), sample(1, 1), sample(4, 4), sample(1, 2)]  # 8, 2, 8, 3 tokens
    assert plan_micro_batches(mixed, max_tokens=20, pack_length=10) == [[[0, 1], [2]], [[3]]]
    assert plan_micro_batches(mixed + [sample(1, 1)], max_tokens=20, pack_length=10) == [[[0, 1], [2]], [[3, 4]]]
    # the count limit and the budget together
    assert plan_micro_batches(five, micro_batch_size=3, max_tokens=100, pack_length=10) == [[[0, 1], [2]], [[3, 4]]]


def test_sample_checks():
    with pytest.raises(UserError):
        Sample([1], [2, 3], [4], [-1.0, -1.0], 1.0).check(T)
    with pytest.raises(UserError):
        Sample([1], [2], [5], [-1.0], 1.0).check(T)
    with pytest.raises(UserError, match="first_logprobs"):
        Sample([1], [2], [4], [-1.0], 1.0, first_logprobs=[-1.0, -2.0]).check(T)


def test_clipped_surrogate_branches():
    new = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1]))
    old = torch.zeros(5)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    terms = clipped_surrogate(new, old, adv, eps_low=0.2, eps_high=0.28)
    expected = [-1.28, 1.5, -0.5, 0.8, -2.2]
    assert terms.loss.tolist() == pytest.approx(expected, rel=1e-6)
    assert terms.clipped.tolist() == [True, False, False, True, False]


def test_log_ratio_bound_and_dual_clip_by_hand():
    """Log-ratios of ±30 are clamped to ±20 before the exponential (finite, no gradient beyond);
    the dual clip c = 3 caps a negative advantage's loss at 3|A| (ratio 5: capped, no gradient;
    ratio 2: untouched) and leaves positive advantages alone."""
    new = torch.tensor([30.0, -30.0, math.log(5.0), math.log(2.0), math.log(5.0)], requires_grad=True)
    adv = torch.tensor([-1.0, -1.0, -2.0, -1.0, 1.0])
    plain = clipped_surrogate(new, torch.zeros(5), adv, eps_low=0.2, eps_high=0.28)
    assert plain.ratio.tolist() == pytest.approx([math.exp(20), math.exp(-20), 5.0, 2.0, 5.0], rel=1e-6)
    assert torch.isfinite(plain.loss).all() and plain.loss[0].item() == pytest.approx(math.exp(20), rel=1e-6)
    plain.loss.sum().backward()
    assert new.grad.tolist()[:2] == [0.0, 0.0] and new.grad[2].item() == pytest.approx(10.0, rel=1e-6)
    new.grad = None
    dual = clipped_surrogate(new, torch.zeros(5), adv, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    assert dual.loss.tolist() == pytest.approx([3.0, 0.8 * 1.0, 6.0, 2.0, -1.28], rel=1e-6)
    assert dual.clipped.tolist() == [True, True, True, False, True]
    dual.loss.sum().backward()
    assert new.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 2.0, 0.0], abs=1e-6)
    tight = clipped_surrogate(new.detach(), torch.zeros(5), adv, 0.2, 0.28, log_ratio_bound=1.0)
    assert tight.ratio.tolist() == pytest.approx([math.e, 1 / math.e, math.e, 2.0, math.e], rel=1e-6)


def test_token_logprobs_use_temperature_and_entropy_is_finite():
    logits = torch.tensor([[2.0, 0.0, -1e4]])
    lp, logp = token_logprobs(logits, torch.tensor([1]), torch.tensor([0.5]))
    assert lp.item() == pytest.approx(-math.log1p(math.exp(4.0)), rel=1e-6)
    assert torch.isfinite(entropy(logp)).all()


@pytest.mark.parametrize(
    "bad",
    [
        dict(tensor_parallel=2),
        dict(pipeline_parallel=2),
        dict(context_parallel=2),
        dict(eps_low=1.0),
        dict(lr_schedule="cosine", warmup_steps=4, decay_steps=3),
        dict(micro_batch_size=0),
        dict(aggregation="sum"),
        dict(clip_ratio_c=1.0),
        dict(log_ratio_bound=0.0),
        dict(log_ratio_bound=math.inf),
    ],
)
def test_config_rejects_what_it_cannot_run(bad):
    with pytest.raises(UserError):
        TrainerConfig(**bad)


def test_config_defaults_on_cpu():
    cfg = TrainerConfig()
    if not torch.cuda.is_available():
        assert cfg.resolved_device == "cpu" and cfg.torch_dtype == torch.float32
    assert (cfg.eps_low, cfg.eps_high, cfg.aggregation) == (0.2, 0.28, "auto")
    assert (cfg.resolved_aggregation, cfg.loop_weighting) == ("token_mean", "exit")
    assert (cfg.clip_ratio_c, cfg.log_ratio_bound) == (None, 20.0)


def test_token_cost_counts_full_depth_positions_as_one_and_shallow_ones_by_their_loops():
    cost = TokenCost(loop=0.2, idle=0.1)  # the rest, 1 - 4 x 0.2 = 0.2, whatever a position runs
    assert cost.of_group(100, [100, 100, 100, 100], gathers=True) == pytest.approx(100)
    # 95 of 100 positions stop at 2: loops 3 and 4 gather the other 5, and the 95 idle ones keep
    # a tenth of a loop each (their K/V in the copy the gathered queries attend over)
    by_hand = 100 * 0.2 + 0.2 * (100 + 100) + 2 * 0.2 * (5 + 0.1 * 95)
    assert cost.of_group(100, [100, 100, 5, 5], gathers=True) == pytest.approx(by_hand)
    # where the replay does not gather (exact mode's torch path): every loop any position runs runs on all
    assert cost.of_group(100, [100, 100, 5, 5], gathers=False) == pytest.approx(100)
    # 92 of 100 running: the loop runs every position (model/ouro.py GATHER_BELOW)
    assert cost.of_group(100, [100, 92, 92, 92], gathers=True) == pytest.approx(100)
    # no position runs loop 4: the replay stops after loop 3
    assert cost.of_group(100, [100, 100, 100, 0], gathers=True) == pytest.approx(100 - 0.2 * 100)


@pytest.mark.parametrize("gathers", [True, False])
def test_a_token_cost_budget_packs_shallow_batches_denser_and_bounds_what_the_replay_runs(gathers):
    cost = TokenCost(loop=0.2, idle=0.1)
    shallow = [Sample([1, 2], [5] * 14, [2] * 14, [-1.0] * 14, 1.0) for _ in range(12)]  # 16 positions each
    deep = [Sample([1, 2], [5] * 14, [4] * 14, [-1.0] * 14, 1.0) for _ in range(12)]
    plain = plan_micro_batches(shallow, max_tokens=64)
    assert [len(mb) for mb in plain] == [4, 4, 4]
    # a batch whose every position runs all loops groups as the plain count does
    assert plan_micro_batches(deep, max_tokens=64, cost=cost, num_loops=T, gathers=gathers) == plan_micro_batches(
        deep, max_tokens=64
    )
    weighted = plan_micro_batches(shallow, max_tokens=64, cost=cost, num_loops=T, gathers=gathers)
    if not gathers:  # loops 3-4 run on every position there: no saving
        assert weighted == plain
        return
    # a sample's 16 positions: 3 at depth 4 (the prompt's 2, the last: Sample.depths), 13 at 2
    # 16 x 0.2 + 0.2 x 2 x 16 + 2 x 0.2 x (3 + 0.1 x 13) = 11.32, so 5 per 64
    assert [len(mb) for mb in weighted] == [5, 5, 2]
    w = loss_weights(shallow, "token_mean", global_tokens=12 * 14, global_samples=12)
    for rows in weighted:  # the cost the planner counted is what the replay's loops really run
        mb = build_micro_batch(shallow, w, T, rows=rows)
        ran = positions_per_loop(mb.depths, mb.attention_mask)
        total = mb.padded_tokens
        counted = total * (1 - T * cost.loop) + sum(cost.loop * (r + cost.idle * (total - r)) for r in ran)
        assert counted <= 64
        assert ran == [total, total, 3 * len(rows), 3 * len(rows)]  # only the deep positions run loops 3-4


@pytest.mark.parametrize(
    ("pack", "depths", "budget"),
    [
        (True, [1, 2, 2, 3, 4], 200),  # mixed exits
        (True, [4, 4, 4, 4, 3], 120),  # nearly full depth: loops around the gather share
        (False, [1, 2, 2, 3, 4], 120),
    ],
)
def test_a_token_cost_budget_holds_for_the_tensors_the_replay_runs(pack, depths, budget):
    """Mixed lengths and exit depths, packed rows or padded ones: every micro-batch the planner
    closes costs, by the loops the replay really runs on its tensor, at most the budget (a
    row narrower than the capacity can turn a loop the capacity would gather into one run
    whole: the planner counts the tensor it builds)."""
    import random

    cost = TokenCost(loop=0.2, idle=0.1)
    for seed in range(12):
        rng = random.Random(seed)
        samples = []
        for _ in range(60):
            m, n = rng.randint(1, 6), rng.randint(2, 20)
            samples.append(
                Sample(list(range(1, m + 1)), [5] * n, [rng.choice(depths) for _ in range(n)], [-1.0] * n, 1.0)
            )
        plan = plan_micro_batches(
            samples, max_tokens=budget, pack=pack, pack_length=26 if pack else None, cost=cost, num_loops=T
        )
        assert sorted(i for rows in plan for row in rows for i in row) == list(range(60))
        w = loss_weights(samples, "token_mean", global_tokens=1, global_samples=1)
        for rows in plan:
            mb = build_micro_batch(samples, w, T, rows=rows)
            ran, total = positions_per_loop(mb.depths, mb.attention_mask), mb.padded_tokens
            counted = total * (1 - T * cost.loop) + sum(cost.loop * (r + cost.idle * (total - r)) for r in ran)
            assert counted <= budget + 1e-9, (seed, rows)
