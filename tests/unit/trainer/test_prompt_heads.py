"""A fixed-budget sample replayed as a body (its prompt at the deepest response loop, scoring
r[1:]) and a prompt head (the prompt at T, scoring r[0]) — batching.split_prompts — gives the
loss, its statistics and its gradient of the sample replayed whole, to fp32 rounding on
CPU, and leaves the samples it cannot help whole; those, and the heads, come before the
bodies, so only the first micro-batches run the prompts' deep loops."""

from __future__ import annotations

import random

import pytest
import torch
from _trainer_samples import forward_backward_on_cpu

from ouro_cli.model import build, tiny_config
from ouro_cli.trainer.batching import (
    Sample,
    build_micro_batch,
    loss_weights,
    plan_micro_batches,
    split_prompts,
)

T = 4


def budget_samples(model, n: int, k: int, seed: int) -> list[Sample]:
    """Rollout-like samples of a fixed budget K = k (their rollout logprobs near the model's)."""
    g = random.Random(seed)
    V = model.config.vocab_size
    out = []
    for _ in range(n):
        m, r = g.randint(2, 9), g.randint(2, 12)
        prompt, response = [g.randrange(V) for _ in range(m)], [g.randrange(V) for _ in range(r)]
        exits = [T] + [g.randint(1, k) for _ in range(r - 1)]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response]), torch.tensor([[T] * m + exits[1:] + [T]]))
        lp = torch.log_softmax(logits[0, m - 1 : m + r - 1].float(), -1).gather(-1, torch.tensor(response)[:, None])
        out.append(
            Sample(prompt, response, exits, [float(x) + g.uniform(-0.3, 0.3) for x in lp[:, 0]], g.uniform(-1.5, 1.5))
        )
    return out


def test_parts_score_every_token_once_and_the_deep_parts_come_first():
    samples = [
        Sample([1, 2, 3], [4, 5, 6], [T, 2, 1], [-1.0] * 3, 0.5),  # deepest response loop 2: split
        Sample([1, 2], [4, 5], [T, T], [-1.0] * 2, 1.0),  # reaches T: whole
        Sample([7], [8], [T], [-1.0], 1.0),
    ]  # one token: whole
    w = loss_weights(samples, "sequence_mean", global_tokens=6, global_samples=3)
    parts, weights = split_prompts(samples, w, T, max_overhead=1.0)
    # the samples left whole, then the head, then the body
    assert [(p.prompt_depth, p.scored_from, p.scored) for p in parts] == [
        (None, 0, 2),
        (None, 0, 1),
        (None, 0, 1),
        (2, 1, 2),
    ]
    assert parts[3].depths(T) == [2, 2, 2, 2, 1, 2] and parts[2].depths(T) == [T, T, T, T]
    assert weights == [w[1], w[2], w[0][:1], w[0][1:]]
    # as plans from before `deep_first` cut them: bodies and whole samples in order, heads last
    before, _ = split_prompts(samples, w, T, max_overhead=1.0, deep_first=False)
    assert before == [parts[3], parts[0], parts[1], parts[2]]
    (rows,) = plan_micro_batches(parts, pack_length=8)
    mb = build_micro_batch(parts, weights, T, rows=rows)
    assert mb.num_samples == 3  # a body's head counts its sample, the body does not
    assert sorted(mb.targets.tolist()) == sorted(t for s in samples for t in s.response_ids)


@pytest.mark.parametrize(
    "options",
    [{}, {"loop_weighting": "uniform"}, {"is_correction": "tis"}, {"max_tokens_per_micro_batch": 48}],
    ids=["exit", "uniform", "tis", "small mbs"],
)
def test_split_samples_give_the_whole_samples_loss_and_gradient(options):
    pytest.importorskip("megatron.core")
    model = build(tiny_config(), seed=3).float()
    samples = budget_samples(model, 10, k=2, seed=1)
    whole, g_whole = forward_backward_on_cpu(model, samples, **options)
    # tiny prompts and responses: split them all, whatever the repeat costs
    split, g_split = forward_backward_on_cpu(model, samples, prompt_heads=True, prompt_head_overhead=1.0, **options)
    for key in (
        "loss",
        "entropy",
        "ratio_mean",
        "mismatch_mean",
        "clip_fraction",
        "samples",
        "response_tokens",
        "tokens",
        "layer_tokens_required",
    ):
        if key in whole:
            assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    # the heads replay the prompts' first two loops again: a little more work than required
    assert whole["layer_tokens_required"] < split["layer_tokens_executed"]
    assert g_whole.keys() == g_split.keys()
    for name in g_whole:
        torch.testing.assert_close(g_split[name], g_whole[name], rtol=1e-4, atol=1e-6, msg=name)


def test_geo_mask_keeps_samples_whole():
    pytest.importorskip("megatron.core")
    model = build(tiny_config(), seed=3).float()
    samples = budget_samples(model, 6, k=2, seed=2)
    plain, _ = forward_backward_on_cpu(model, samples, is_correction="geo-mask")
    asked, _ = forward_backward_on_cpu(
        model, samples, is_correction="geo-mask", prompt_heads=True, prompt_head_overhead=1.0
    )
    assert asked["layer_tokens_executed"] == plain["layer_tokens_executed"] and asked["loss"] == plain["loss"]


def test_only_samples_whose_prompt_repeat_is_cheap_are_split():
    short = Sample([1] * 18, [5] * 512, [T] + [2] * 511, [-1.0] * 512, 1.0)  # the e2e shape at K = 2
    long = Sample([1] * 1000, [5] * 512, [T] + [2] * 511, [-1.0] * 512, 1.0)
    w = [[0.5] * 512, [0.5] * 512]
    parts, _ = split_prompts([short, long], w, T)
    # short: (18 + 1) x 2 = 38 repeated of 18 x 4 + 511 x 2 + 4 = 1,098 required (3.5 %); long: 40 %
    assert [(p.length, p.scored_from) for p in parts] == [(1512, 0), (19, 0), (530, 1)]  # the deep parts first


def test_only_the_first_micro_batches_run_the_deep_loops():
    """Short responses stay whole, their prompts at T. Among the bodies each made its micro-batch
    run loops 3 and 4 over its few prompt positions (24 layer calls of host time each, for almost
    no device work); before the bodies, they share the heads' micro-batches."""
    from ouro_cli.model.ouro import positions_per_loop

    lengths = [512, 60, 512, 512, 40, 512, 512, 512]
    samples = [Sample([1] * 18, [5] * n, [T] + [2] * (n - 1), [-1.0] * n, 1.0) for n in lengths]
    weights = [[1.0] * n for n in lengths]
    parts, part_weights = split_prompts(samples, weights, T)
    assert [(p.length, p.scored_from) for p in parts] == [(78, 0), (58, 0)] + [(19, 0)] * 6 + [(530, 1)] * 6
    plan = plan_micro_batches(parts, max_tokens=1100, num_loops=T)  # two bodies to a micro-batch
    deep = [
        len(positions_per_loop(mb.depths, mb.attention_mask)) > 2  # it runs loop 3
        for mb in (build_micro_batch(parts, part_weights, T, rows=rows) for rows in plan)
    ]
    assert deep == [True] + [False] * (len(plan) - 1), deep  # the whole samples and the heads fit one
    assert split_prompts(samples[1:2], weights[1:2], T)[0] == samples[1:2]  # nothing to split: as they were


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_in_exact_mode_heads_and_bodies_score_the_engines_logprobs_to_the_bit(dtype):
    """K = 2 rollouts of the exact engine, trained split: every token's trainer logprob, r[0]'s
    from its head and the others' from the bodies, is the engine's bit for bit."""
    pytest.importorskip("megatron.core")
    import copy

    from ouro_cli.engine import LLM, SamplingParams
    from ouro_cli.settings import ExecutionSettings
    from ouro_cli.trainer import Trainer, TrainerConfig
    from tests.unit.engine.conftest import prompts, tiny_model

    model = tiny_model(0).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    llm = LLM(
        copy.deepcopy(model), max_num_seqs=4, kv_blocks=128, block_size=4, execution=ExecutionSettings(exact=True)
    )
    try:
        params = [
            SamplingParams(max_tokens=16, temperature=1.0, seed=s, logprobs=0, max_loops=2, ignore_eos=True)
            for s in range(4)
        ]
        outs = llm.generate(prompts(4, seed=1), params)
    finally:
        llm.close()
    samples = [Sample(o.prompt_token_ids, o.output_token_ids, o.exit_depths, o.log_probs, 1.0) for o in outs]
    parts, _ = split_prompts(samples, [[1.0] * len(s.response_ids) for s in samples], T, max_overhead=1.0)
    assert [p.scored_from for p in parts] == [0] * 4 + [1] * 4  # four heads, then their bodies
    trainer = Trainer(
        copy.deepcopy(model),
        TrainerConfig(device="cpu", params_dtype=dtype, prompt_heads=True, prompt_head_overhead=1.0),
        exact=True,
    )
    try:
        metrics = trainer.forward_backward(samples)
    finally:
        trainer.close()
    assert metrics["layer_tokens_executed"] > metrics["layer_tokens_required"]  # the prompts' loops 1-2 twice
    assert metrics["logprob_mismatch_max"] == 0.0
