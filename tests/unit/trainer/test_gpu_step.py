"""The trainer on CUDA (bf16 params, fp32 main weights, NCCL world of one): a GRPO step's
gradients agree with the fp32 CPU trainer to bf16 precision, megatron runs without the
CPU layer, and a checkpoint round trip restores weights and optimizer state exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from _trainer_samples import make_samples

from ouro_cli.model import build, tiny_config

pytestmark = pytest.mark.gpu


def test_cuda_step_matches_cpu_and_checkpoints(tmp_path):
    from ouro_cli.mcore.cpu_compat import is_patched
    from ouro_cli.trainer import Trainer, TrainerConfig
    from ouro_cli.trainer.optimizer import torch_optimizers

    model = build(tiny_config(), seed=3)
    samples = make_samples(model, 6, seed=11)
    with Trainer(copy.deepcopy(model), TrainerConfig(device="cpu", lr=1e-3, micro_batch_size=3)) as cpu:
        cpu_metrics = cpu.forward_backward(samples)
        cpu_grads = {k: v.clone() for k, v in cpu.gradients().items()}

    config = TrainerConfig(device="cuda", lr=1e-3, micro_batch_size=3)
    assert config.torch_dtype == torch.bfloat16
    with Trainer(copy.deepcopy(model), config) as gpu:
        metrics = gpu.forward_backward(samples)
        assert not is_patched()
        assert metrics["loss"] == pytest.approx(cpu_metrics["loss"], abs=0.05)
        for name, g in gpu.gradients().items():
            ref = cpu_grads[name]
            rel = (g.float().cpu() - ref).norm() / ref.norm().clamp(min=1e-12)
            assert rel < 0.1, name
        gpu.optimizer_step()
        gpu.train_step(samples)
        gpu.save(tmp_path / "ckpt", iteration=2, extra={"next": 2})
        saved = {k: v.clone() for k, v in gpu.module.state_dict().items()}
        saved_main = [
            p.detach().clone()
            for opt in torch_optimizers(gpu.optimizer)
            for group in opt.param_groups
            for p in group["params"]
        ]
    with Trainer(build(tiny_config(), seed=4), config) as fresh:
        assert fresh.load(tmp_path / "ckpt") == {"next": 2}
        assert fresh.steps_taken == 2
        for k, v in fresh.module.state_dict().items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, saved[k]), k
        main = [p for opt in torch_optimizers(fresh.optimizer) for group in opt.param_groups for p in group["params"]]
        assert all(torch.equal(a, b) for a, b in zip(main, saved_main, strict=True))


def _cuda_gradients(model, samples, deterministic: bool) -> dict[str, torch.Tensor]:
    from ouro_cli.trainer import Trainer, TrainerConfig

    config = TrainerConfig(device="cuda", lr=1e-3, micro_batch_size=16, deterministic=deterministic)
    with Trainer(copy.deepcopy(model), config) as trainer:
        trainer.forward_backward(samples)
        return {k: v.detach().clone() for k, v in trainer.gradients().items()}


def test_cuda_gradients_repeat_bit_for_bit():
    """Two trainers, same weights and samples: the same gradient bits (determinism.py).
    Packed rows with document masks take SDPA's memory-efficient backward, whose default
    accumulation order changes between runs; the long responses give it many blocks."""
    model = build(tiny_config(), seed=3)
    samples = make_samples(model, 48, seed=11, max_prompt=40, max_response=120)
    first, second = (_cuda_gradients(model, samples, deterministic=True) for _ in range(2))
    for name, grad in first.items():
        assert torch.equal(grad, second[name]), name
