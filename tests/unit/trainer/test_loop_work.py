"""The trainer's replay executes the layer work its depths require and little more: the
update's `layer_tokens_executed` over `layer_tokens_required` (`train_...` in the run's
metrics) is at most 1.05 for a K = 2 rollout and for the mixed depths of threshold exits
(rollouts of the engine), packed as the trainer packs; the replay that ran every loop on
every position executed 1.5x and more of it."""

from __future__ import annotations

import random

import pytest
import torch

from ouro_cli.model import ouro
from ouro_cli.trainer.batching import (
    Sample,
    WorkCounter,
    build_micro_batch,
    loss_weights,
    plan_micro_batches,
)

T = 4
LIMIT = 1.05


def work(samples, layers: int = 2, **plan) -> WorkCounter:
    weights = loss_weights(samples, "token_mean", sum(len(s.response_ids) for s in samples), len(samples))
    counter = WorkCounter()
    for rows in plan_micro_batches(samples, **plan):
        counter.add_micro_batch(build_micro_batch(samples, weights, T, rows=rows), layers, recompute=False)
    return counter


def k2_samples(n: int = 12, seed: int = 0) -> list[Sample]:
    g = random.Random(seed)
    out = []
    for _ in range(n):
        m, k = g.randint(16, 64), g.randint(32, 128)
        out.append(
            Sample(
                [g.randrange(3, 96) for _ in range(m)],
                [g.randrange(3, 96) for _ in range(k)],
                [T] + [2] * (k - 1),
                [-1.0] * k,
                g.uniform(-1, 1),
            )
        )
    return out


@pytest.fixture(scope="module")
def threshold_samples() -> list[Sample]:
    """Rollouts of the tiny engine model with exit threshold 0.5: every depth 1..T occurs."""
    from ouro_cli.engine import LLM, SamplingParams
    from tests.unit.engine.conftest import prompts, tiny_model

    llm = LLM(tiny_model(0), max_num_seqs=8, kv_blocks=256, block_size=4, cuda_graphs=False)
    try:
        params = [
            SamplingParams(max_tokens=40, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True) for s in range(8)
        ]
        outs = llm.generate(prompts(8, seed=2, lo=8, hi=24), params)
    finally:
        llm.close()
    depths = {d for o in outs for d in o.exit_depths[1:]}
    assert depths == set(range(1, T + 1)), depths
    return [Sample(o.prompt_token_ids, o.output_token_ids, o.exit_depths, o.log_probs, 1.0) for o in outs]


@pytest.mark.parametrize("plan", [{}, {"pack_length": 256}, {"pack": False}], ids=["packed", "long rows", "unpacked"])
def test_k2_executes_what_it_requires(monkeypatch, plan):
    samples = k2_samples()
    counter = work(samples, **plan)
    assert counter.executed / counter.required <= LIMIT, (counter.executed, counter.required)
    monkeypatch.setattr(ouro, "GATHER_BELOW", 0.0)  # every loop on every position: the replay before
    assert work(samples, **plan).executed / counter.required > 1.5


def test_threshold_exits_execute_what_they_require(monkeypatch, threshold_samples):
    counter = work(threshold_samples)
    assert counter.executed / counter.required <= LIMIT, (counter.executed, counter.required)
    monkeypatch.setattr(ouro, "GATHER_BELOW", 0.0)
    assert work(threshold_samples).executed / counter.required > 1.5


def test_the_trainer_reports_the_work_it_ran(threshold_samples):
    pytest.importorskip("megatron.core")
    from ouro_cli.model import build, tiny_config
    from ouro_cli.trainer import Trainer, TrainerConfig

    trainer = Trainer(
        build(tiny_config(vocab_size=96), seed=0), TrainerConfig(device="cpu", max_tokens_per_micro_batch=128)
    )
    try:
        metrics = trainer.forward_backward(threshold_samples)
        assert all(torch.isfinite(g).all() for g in trainer.gradients().values())
    finally:
        trainer.close()
    assert metrics["micro_batches"] > 1
    counter = work(threshold_samples, max_tokens=128)
    assert metrics["layer_tokens_executed"] == counter.executed
    assert metrics["layer_tokens_required"] == counter.required
    assert metrics["layer_tokens_executed"] / metrics["layer_tokens_required"] <= LIMIT
    # loop passes: the loops each micro-batch ran, and those that gathered (threshold exits: some do)
    assert (metrics["loop_passes"], metrics["gathered_loop_passes"]) == (counter.loop_passes, counter.gathered_passes)
    assert metrics["micro_batches"] <= counter.loop_passes <= 4 * metrics["micro_batches"]
    assert 0 < counter.gathered_passes < counter.loop_passes
