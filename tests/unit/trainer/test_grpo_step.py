"""One GRPO step in this process (fp32, CPU, world of one): the trainer's gradients
against an independent autograd computation, and invariance of loss and gradients to
packing, micro-batching with accumulation, and activation recompute."""

from __future__ import annotations

import copy

import pytest
import torch
from _trainer_samples import forward_backward_on_cpu, make_samples

from ouro_cli.model import build, tiny_config

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def base_model():
    return build(tiny_config(), seed=3)


@pytest.fixture(scope="module")
def samples(base_model):
    return make_samples(base_model, 6, seed=11, temperature=0.8)


def run_forward_backward(model, samples, **options):
    return forward_backward_on_cpu(model, samples, **options)


def reference_loss_and_grads(model, samples, eps_low=0.2, eps_high=0.28):
    """Plain PyTorch, one sample at a time, written without the trainer's code."""
    model = copy.deepcopy(model)
    model.zero_grad()
    total_tokens = sum(len(s.response_ids) for s in samples)
    T = model.config.num_loops
    total = torch.zeros(())
    for s in samples:
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        depths = torch.tensor([[T] * len(s.prompt_ids) + list(s.exit_depths[1:]) + [T]])
        logits = model(ids, depths)[0]
        m, n = len(s.prompt_ids), len(s.response_ids)
        for j in range(n):
            row = logits[m - 1 + j].float() / s.temperature
            new = row[s.response_ids[j]] - torch.logsumexp(row, 0)
            ratio = torch.exp(new - s.rollout_logprobs[j])
            a = s.advantage
            clipped = min(max(ratio, torch.tensor(1 - eps_low)), torch.tensor(1 + eps_high))
            term = -torch.minimum(ratio * a, clipped * a)
            total = total + term / total_tokens
    total.backward()
    grads = {
        name: p.grad.detach().clone()
        for name, p in model.named_parameters()
        if not name.startswith("model.early_exit_gate")
    }
    return float(total.detach()), grads


def assert_grads_close(a, b, atol=1e-6, rtol=1e-5):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=name)


def test_gradients_equal_independent_autograd(base_model, samples):
    metrics, grads = run_forward_backward(base_model, samples, micro_batch_size=4, pack_length=16)
    ref_loss, ref_grads = reference_loss_and_grads(base_model, samples)
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-6)
    assert 0 < metrics["clip_fraction"] < 1  # both branches of the surrogate are exercised
    assert_grads_close(grads, ref_grads)
    assert "model.early_exit_gate.weight" not in grads
    assert all(g.abs().sum() > 0 for name, g in grads.items() if "layers" in name)


def test_packing_microbatching_and_recompute_do_not_change_the_gradient(base_model, samples):
    base_metrics, base = run_forward_backward(base_model, samples, pack=False)  # one padded row each, one micro-batch
    variants = {
        "packed, one row": dict(pack=True, pack_length=100),
        "packed, rows as long as the longest sample": dict(pack=True),
        "two micro-batches": dict(pack=False, micro_batch_size=3),
        "packed, two micro-batches, rows of 14": dict(pack=True, micro_batch_size=3, pack_length=14),
        "recompute": dict(pack=True, micro_batch_size=2, recompute=True),
        "token budget, one sample per micro-batch": dict(max_tokens_per_micro_batch=14),
        "token budget, packed rows of 16": dict(max_tokens_per_micro_batch=32, pack_length=16),
        "token budget with recompute": dict(max_tokens_per_micro_batch=28, recompute=True),
    }
    for label, options in variants.items():
        metrics, grads = run_forward_backward(base_model, samples, **options)
        if "max_tokens_per_micro_batch" in options:
            assert metrics["micro_batches"] > 1, label
            assert metrics["micro_batch_tokens_max"] <= options["max_tokens_per_micro_batch"], label
        assert metrics["loss"] == pytest.approx(base_metrics["loss"], abs=1e-6), label
        assert metrics["logprob_mismatch_mean"] == pytest.approx(base_metrics["logprob_mismatch_mean"], abs=1e-6), label
        assert_grads_close(grads, base)
        if options.get("recompute"):
            assert metrics["layer_tokens_recomputed"] == metrics["layer_tokens_executed"] > 0
        else:
            assert metrics["layer_tokens_recomputed"] == 0


def test_sequence_mean_aggregation(base_model, samples):
    metrics, grads = run_forward_backward(base_model, samples[:3], aggregation="sequence_mean", micro_batch_size=2)
    # Reference: average of per-sample token means == token-mean weighted per sample.
    per_sample = [reference_loss_and_grads(base_model, [s]) for s in samples[:3]]
    ref_loss = sum(loss for loss, _ in per_sample) / 3
    ref_grads = {k: sum(g[k] for _, g in per_sample) / 3 for k in per_sample[0][1]}
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-6)
    assert_grads_close(grads, ref_grads)


def test_grad_norm_schedule_frozen_gate_and_publication(base_model, samples):
    import math

    from ouro_cli.checkpoint import expected_shapes
    from ouro_cli.trainer import Trainer, TrainerConfig

    _, ref_grads = reference_loss_and_grads(base_model, samples)
    ref_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in ref_grads.values()))
    config = TrainerConfig(
        device="cpu", lr=1e-2, min_lr=1e-3, lr_schedule="cosine", warmup_steps=2, decay_steps=5, clip_grad=0.5
    )
    gate_before = base_model.model.early_exit_gate.weight.detach().clone()
    with Trainer(copy.deepcopy(base_model), config) as trainer:
        lrs, norms = [], []
        for _ in range(6):
            metrics = trainer.train_step(samples)
            lrs.append(metrics["lr"])
            norms.append(metrics["grad_norm"])
        published = dict(trainer.named_weights_for_publication())
        assert trainer.steps_taken == 6
    # Global L2 norm before clipping, as computed independently.
    assert norms[0] == pytest.approx(ref_norm, rel=1e-5)
    # Megatron warmup from 0 over two steps, then cosine to min_lr at step 5, then min_lr.
    cosine = [1e-3 + 0.5 * (math.cos(math.pi * k / 3) + 1) * 9e-3 for k in range(4)]
    assert lrs == pytest.approx([0.0, 5e-3, *cosine[:3], 1e-3])
    assert cosine[3] == pytest.approx(1e-3)
    # Publication: every physical tensor once, HF names and shapes, the frozen gate untouched.
    shapes = expected_shapes(base_model.config)
    assert {k: tuple(v.shape) for k, v in published.items()} == shapes
    assert torch.equal(published["model.early_exit_gate.weight"], gate_before)
    assert not torch.equal(published["lm_head.weight"], base_model.lm_head.weight)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_non_finite_gradient_skips_the_optimizer_step(base_model, samples, dtype):
    """Megatron's fp32 and bf16 optimizers would apply a NaN gradient; the trainer's step
    finds the non-finite norm first, skips the step and the LR schedule, and leaves every
    weight (and Adam) as it was; a finite batch afterwards steps normally."""
    import dataclasses
    import math

    from ouro_cli.trainer import Trainer, TrainerConfig

    poisoned = [dataclasses.replace(samples[0], advantage=float("nan")), *samples[1:]]
    with Trainer(copy.deepcopy(base_model), TrainerConfig(device="cpu", lr=1e-2, params_dtype=dtype)) as trainer:
        before = {k: v.clone() for k, v in trainer.named_weights_for_publication()}
        metrics = trainer.train_step(poisoned)
        assert not metrics["step_applied"] and math.isnan(metrics["grad_norm"])
        assert trainer.steps_taken == 0
        for name, tensor in trainer.named_weights_for_publication():
            assert torch.equal(tensor, before[name]), name
        metrics = trainer.train_step(samples)
        assert metrics["step_applied"] and math.isfinite(metrics["grad_norm"]) and trainer.steps_taken == 1
        assert not torch.equal(
            dict(trainer.named_weights_for_publication())["lm_head.weight"], before["lm_head.weight"]
        )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offloaded_optimizer_trains_bit_for_bit(base_model, samples, dtype):
    """--offload-optimizer keeps the main weights and Adam moments in host memory between
    steps; the weights, main weights and moments after three steps are the same bits."""
    from ouro_cli.trainer import Trainer, TrainerConfig
    from ouro_cli.trainer.optimizer import torch_optimizers

    def run(offload: bool, keep: bool = False):
        config = TrainerConfig(device="cpu", params_dtype=dtype, lr=1e-3, offload_optimizer=offload)
        with Trainer(copy.deepcopy(base_model), config) as trainer:
            if keep:  # --offload-optimizer auto: the state stays after a step, leaves only when sent
                trainer.offload.keep_after_step = True
            for step in range(3):
                trainer.train_step(samples)
                if keep:
                    assert not trainer.offload.on_host
                    if step == 1:
                        trainer.offload.to_host()
            assert (trainer.offload is not None) == offload and (not offload or keep or trainer.offload.on_host)
            weights = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
            state = [
                t.clone()
                for opt in torch_optimizers(trainer.optimizer)
                for s in opt.state.values()
                for t in s.values()
                if isinstance(t, torch.Tensor)
            ]
            mains = [
                p.detach().clone()
                for opt in torch_optimizers(trainer.optimizer)
                for g in opt.param_groups
                for p in g["params"]
            ]
        return weights, state, mains

    (w0, s0, m0) = run(False)
    for w1, s1, m1 in (run(True), run(True, keep=True)):
        assert w0.keys() == w1.keys() and all(torch.equal(w0[n], w1[n]) for n in w0)
        assert len(s0) == len(s1) > 0 and all(torch.equal(a, b) for a, b in zip(s0, s1, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(m0, m1, strict=True))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_released_gradients_free_their_buffer_and_train_bit_for_bit(base_model, samples, dtype):
    """Between updates the loop frees the fp32 grad buffer (Trainer.release_gradients) so a
    rollout can use its memory; the next forward_backward allocates it again. The buffer
    really holds no storage while released, and three steps give the same weights, main
    weights and moments as a trainer that keeps it."""
    from ouro_cli.trainer import Trainer, TrainerConfig
    from ouro_cli.trainer.optimizer import torch_optimizers

    def run(release: bool):
        config = TrainerConfig(device="cpu", params_dtype=dtype, lr=1e-3)
        with Trainer(copy.deepcopy(base_model), config) as trainer:
            for _ in range(3):
                trainer.train_step(samples)
                if release:
                    trainer.release_gradients()
                    assert trainer.gradients() == {}
                    assert all(b.grad_data.untyped_storage().nbytes() == 0 for b in trainer.ddp.buffers)
            weights = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
            state = [
                t.clone()
                for opt in torch_optimizers(trainer.optimizer)
                for s in opt.state.values()
                for t in s.values()
                if isinstance(t, torch.Tensor)
            ]
            mains = [
                p.detach().clone()
                for opt in torch_optimizers(trainer.optimizer)
                for g in opt.param_groups
                for p in g["params"]
            ]
            trainer.forward_backward(samples)  # allocated again: the gradients are there
            assert not trainer.gradients_released and trainer.gradients()
            assert all(b.grad_data.untyped_storage().nbytes() > 0 for b in trainer.ddp.buffers)
        return weights, state, mains

    (w0, s0, m0), (w1, s1, m1) = run(False), run(True)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[n], w1[n]) for n in w0)
    assert len(s0) == len(s1) > 0 and all(torch.equal(a, b) for a, b in zip(s0, s1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(m0, m1, strict=True))
