"""`--is-correction` over several optimizer steps per update (Trainer.train_update): the PPO ratio
and the importance weight are both taken against the update's first policy. Checked against a
hand computation over 2 mini-batches × 2 epochs — each step's loss, clip fraction and largest
ratio, from a plain loop over the samples written without the trainer's code — in which the
policy has moved after the first step, so the ratio and the clip are not trivial; the dual
clip (`--clip-ratio-c`) and loop weighting in the same computation. With one step per update
the extra forward is skipped, and giving a step the first policy's logprobs changes no bit."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _trainer_samples import make_samples

from ouro_cli.model import build, tiny_config

pytest.importorskip("megatron.core")

EPS_LOW, EPS_HIGH = 0.2, 0.28


@pytest.fixture(scope="module")
def base_model():
    return build(tiny_config(), seed=5)


@pytest.fixture(scope="module")
def samples(base_model):
    # rollout logprobs off the model's by up to ±0.4: the weights and masks are not all 1
    return make_samples(base_model, 6, seed=4, noise=0.4)


def logprobs_by_hand(model, s) -> list[float]:
    """log π(y_j) of each response token of `s` under `model`: the sample alone, replayed at its
    depths, log-softmax in fp64."""
    T = model.config.num_loops
    m, n = len(s.prompt_ids), len(s.response_ids)
    ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
    depths = torch.tensor([[T] * m + list(s.exit_depths[1:]) + [T]])
    with torch.no_grad():
        logits = model(ids, depths)[0].double()
    out = []
    for j in range(n):
        row = logits[m - 1 + j] / s.temperature
        out.append(float(row[s.response_ids[j]] - torch.logsumexp(row, 0)))
    return out


def step_by_hand(policy, batch, first, mode, bounds, c):
    """(loss, clipped tokens, largest ratio, tokens, tokens the dual clip capped) of one token-mean
    step on `batch`: the ratio against `first` (each sample's logprobs under the update's first
    policy), the weight or mask from first vs the rollout's logprobs."""
    low, high = bounds
    tokens = sum(len(s.response_ids) for s in batch)
    loss, clipped, largest, capped = 0.0, 0, 0.0, 0
    for s in batch:
        new = logprobs_by_hand(policy, s)
        for j, a in enumerate([s.advantage] * len(new)):
            ratio = math.exp(new[j] - first[id(s)][j])
            mismatch = math.exp(first[id(s)][j] - s.rollout_logprobs[j])
            weight = min(mismatch, high) if mode == "tis" else float(low <= mismatch <= high)
            term = -min(ratio * a, min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH) * a)
            if c is not None and a < 0:
                capped += ratio > c
                term = min(term, -c * a)
            loss += weight * term / tokens
            clipped += (a > 0 and ratio > 1 + EPS_HIGH) or (
                a < 0 and (ratio < 1 - EPS_LOW or (c is not None and ratio > c))
            )
            largest = max(largest, ratio)
    return loss, clipped, largest, tokens, capped


@pytest.mark.parametrize(
    "mode, bounds, c, loops",
    [("tis", (0.5, 1.5), None, "exit"), ("mis", (0.7, 1.4), 1.1, "uniform")],
    ids=["tis", "mis-dual-clip-uniform"],
)
def test_two_mini_batches_two_epochs_by_hand(base_model, samples, mode, bounds, c, loops):
    """Loop weighting changes the gradient, not the loss's value (docs/grpo.md §5): the hand
    computation holds under it too."""
    from ouro_cli.trainer import Trainer, TrainerConfig

    a, b = samples[:3], samples[3:]
    first = {id(s): logprobs_by_hand(base_model, s) for s in samples}
    config = TrainerConfig(
        device="cpu", lr=1e-2, is_correction=mode, is_bounds=list(bounds), clip_ratio_c=c, loop_weighting=loops
    )
    steps = []
    with Trainer(copy.deepcopy(base_model), config) as trainer:
        forward_backward = trainer.forward_backward

        def recording(batch, **attempts):  # the policy each step starts from, and what the step reported
            policy = copy.deepcopy(trainer.model)
            metrics = forward_backward(batch, **attempts)
            steps.append((policy, metrics))
            return metrics

        trainer.forward_backward = recording
        out = trainer.train_update([a, b], epochs=2)
    assert out["optimizer_steps"] == 4 and len(steps) == 4
    fractions, capped = [], 0
    for (policy, metrics), batch in zip(steps, [a, b, a, b], strict=True):
        loss, clipped, largest, tokens, dual = step_by_hand(policy, batch, first, mode, bounds, c)
        capped += dual
        assert metrics["loss"] == pytest.approx(loss, abs=1e-6)
        assert abs(metrics["clip_fraction"] * tokens - clipped) <= 1  # a token at a bound may round either way
        assert metrics["ratio_max"] == pytest.approx(largest, rel=1e-5)
        fractions.append(clipped / tokens)
    # the first step ran on the policy that sampled; every later one on a policy that moved
    assert fractions[0] == 0 and steps[0][1]["ratio_max"] == 1.0
    assert all(0 < f < 1 for f in fractions[1:]), fractions
    assert (capped > 0) == (c is not None)  # the dual clip took part where it was on


def test_one_step_takes_its_reference_from_its_own_forward(base_model, samples, monkeypatch):
    """With one step per update no extra forward runs (`with_first_logprobs` is not called), and a
    step given the first policy's logprobs computes every bit the step without them does, with
    prompt heads and several micro-batches too (the logprobs come back to the right tokens)."""
    from ouro_cli.trainer import Trainer, TrainerConfig

    for options in ({}, {"prompt_heads": True, "prompt_head_overhead": 1.0, "micro_batch_size": 2}):
        config = TrainerConfig(device="cpu", lr=1e-2, is_correction="tis", is_bounds=[0.5, 1.5], **options)
        with Trainer(copy.deepcopy(base_model), config) as trainer:
            with monkeypatch.context() as patch:
                patch.setattr(Trainer, "with_first_logprobs", lambda *_: pytest.fail("an extra forward ran"))
                alone = trainer.train_update([samples])
            alone_params = [p.detach().clone() for p in trainer.module.parameters()]
        with Trainer(copy.deepcopy(base_model), config) as trainer:
            given = trainer.with_first_logprobs(samples)
            for s, g in zip(samples, given, strict=True):
                assert s.first_logprobs is None and g.first_logprobs == pytest.approx(
                    logprobs_by_hand(base_model, s), abs=1e-5
                )
            with_first = trainer.train_step(given)
            given_params = [p.detach().clone() for p in trainer.module.parameters()]
        assert all(torch.equal(x, y) for x, y in zip(alone_params, given_params, strict=True)), options
        for key in ("loss", "clip_fraction", "ratio_max", "ratio_mean", "is_weight_mean", "grad_norm"):
            assert alone[key] == with_first[key], (key, options)
