"""Several optimizer steps per update (`Trainer.train_update`): each step's ratio is taken against
the rollout's logprobs, an empty mini-batch takes no step but moves the LR schedule, the schedule
counts steps, and `combine_steps` reduces the steps' figures as documented."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _trainer_samples import make_samples

from ouro_cli.model import build, tiny_config
from ouro_cli.trainer.batching import loss_weights
from ouro_cli.trainer.step import combine_steps


def test_combine_steps_by_hand():
    def step(loss, norm, lr, tokens, clip, epoch=0, mismatch=0.0):
        return {
            "loss": loss,
            "grad_norm": norm,
            "lr": lr,
            "step_applied": True,
            "epoch": epoch,
            "response_tokens": tokens,
            "samples": 2,
            "tokens": tokens + 4,
            "padded_tokens": tokens + 6,
            "clip_fraction": clip,
            "ratio_mean": 1.0 + clip,
            "entropy": 2.0,
            "ratio_max": 1.0 + 2 * clip,
            "micro_batch_tokens_max": tokens,
            "micro_batches": 1,
            "layer_tokens_executed": 10,
            "logprob_mismatch_mean": mismatch,
            "logprob_mismatch_max": 2 * mismatch,
            "forward_backward_s": 0.5,
            "logprob_mismatch_mean_by_depth": {"2": mismatch},
            "logprob_mismatch_max_by_depth": {"2": 2 * mismatch},
            "is_weight_mean": 1.0 - clip,
            "is_weight_max": 1.0 + clip,
            "is_masked_fraction": clip / 2,
        }

    steps = [
        step(1.0, 2.0, 0.1, 10, 0.0, mismatch=1e-7),
        None,
        step(3.0, 1.0, 0.2, 30, 0.4, mismatch=0.5),
        step(2.0, 5.0, 0.3, 10, 0.2, epoch=1, mismatch=0.9),
    ]
    out = combine_steps(steps)
    assert (out["optimizer_steps"], out["empty_mini_batches"]) == (3, 1)
    assert out["loss"] == 2.0 and out["step_losses"] == [1.0, 3.0, 2.0]
    assert out["grad_norm"] == 5.0 and out["lr"] == 0.1 and out["lrs"] == [0.1, 0.2, 0.3]
    assert out["logprob_mismatch_mean"] == 1e-7 and out["logprob_mismatch_max"] == 2e-7  # the first step's
    assert out["logprob_mismatch_mean_by_depth"] == {"2": 1e-7} and out["logprob_mismatch_max_by_depth"] == {"2": 2e-7}
    assert out["is_weight_mean"] == pytest.approx((1.0 * 10 + 0.6 * 30 + 0.8 * 10) / 50)  # token means, every step
    assert out["is_masked_fraction"] == pytest.approx((0.2 * 30 + 0.1 * 10) / 50) and out["is_weight_max"] == 1.4
    assert (out["samples"], out["response_tokens"]) == (4, 40)  # the first epoch: the update's data once
    assert out["layer_tokens_executed"] == 30 and out["micro_batches"] == 3 and out["forward_backward_s"] == 1.5
    assert out["clip_fraction"] == pytest.approx((0 * 10 + 0.4 * 30 + 0.2 * 10) / 50)
    assert out["ratio_max"] == pytest.approx(1.8) and out["micro_batch_tokens_max"] == 30
    assert math.isnan(
        combine_steps([step(1.0, 9.0, 0.1, 10, 0.0), step(1.0, float("nan"), 0.1, 10, 0.0)])["grad_norm"]
    )  # a non-finite norm wins over any finite one
    nothing = combine_steps([None, None])
    assert nothing["optimizer_steps"] == 0 and nothing["loss"] is None and nothing["step_losses"] == []


def test_constant_length_weights_by_hand():
    from ouro_cli.trainer.batching import Sample

    samples = [Sample([1], [2, 3, 4], [4, 4, 4], [-1.0] * 3, 1.0), Sample([1], [5], [4], [-1.0], -1.0)]
    # Dr. GRPO: every token 1 / (samples · L) over the global batch (here 4 samples, L = 8)
    assert loss_weights(samples, "constant_length", global_tokens=9, global_samples=4, length=8) == [
        [1 / 32] * 3,
        [1 / 32],
    ]
    with pytest.raises(ValueError, match="length budget"):
        loss_weights(samples, "constant_length", global_tokens=9, global_samples=4)


pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def base_model():
    return build(tiny_config(), seed=7)


@pytest.fixture(scope="module")
def samples(base_model):
    # the rollout logprobs are the model's own: the first step's ratios are exactly 1 up to replay rounding
    return make_samples(base_model, 6, seed=2, temperature=1.0, noise=0.0)


def params(trainer):
    return {k: v.detach().clone() for k, v in trainer.module.named_parameters()}


def test_two_mini_batches_are_two_steps_against_the_rollout_logprobs(base_model, samples):
    from ouro_cli.trainer import Trainer, TrainerConfig

    config = TrainerConfig(device="cpu", lr=3e-2, warmup_steps=4)
    a, b = samples[:3], samples[3:]
    with Trainer(copy.deepcopy(base_model), config) as trainer:
        out = trainer.train_update([a, [], b], epochs=2)
        combined, steps = params(trainer), trainer.steps_taken
    with Trainer(copy.deepcopy(base_model), config) as trainer:
        first = trainer.train_step(a)
        trainer.scheduler.step(increment=1)  # the empty mini-batch: no step, the schedule moves
        second = trainer.train_step(b)
        third = trainer.train_step(a)  # the second epoch, in the same order
        trainer.scheduler.step(increment=1)
        trainer.train_step(b)
        by_hand = params(trainer)
    assert all(torch.equal(combined[k], by_hand[k]) for k in combined)
    assert (out["optimizer_steps"], out["empty_mini_batches"], steps) == (4, 2, 6)
    # warmup over 4 scheduler steps: the step at schedule position s (0-based) runs at lr · s / 4
    assert out["lrs"] == pytest.approx([0.0, 0.5 * 3e-2, 0.75 * 3e-2, 3e-2])  # positions 0, 2, 3, 5
    # the first step ran on the sampling policy (at LR 0: warmup's first step), and so did the
    # second; the third, after a step of 0.5 lr, is clipped against the same rollout logprobs
    for sampled in (first, second):
        assert sampled["ratio_max"] == pytest.approx(1.0, abs=1e-5) and sampled["clip_fraction"] == 0
    assert third["ratio_max"] > 1.28 and third["clip_fraction"] > 0
    assert out["logprob_mismatch_max"] == first["logprob_mismatch_max"] < 1e-5
    assert out["samples"] == len(samples) and out["response_tokens"] == sum(len(s.response_ids) for s in samples)
    assert math.isfinite(out["loss"]) and out["step_applied"]
