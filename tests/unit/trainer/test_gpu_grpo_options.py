"""Loop weighting and several steps per update on CUDA (bf16 params): the exit-pdf weighted
gradient agrees with the fp32 CPU trainer's to bf16 precision and is bit-identical run to run
(deterministic kernels, so a resume repeats it), and `train_update` takes its steps."""

from __future__ import annotations

import copy

import pytest
import torch
from _trainer_samples import make_samples

from ouro_cli.model import build, tiny_config

pytestmark = pytest.mark.gpu


def _run(model, samples, device):
    from ouro_cli.trainer import Trainer, TrainerConfig

    config = TrainerConfig(device=device, lr=1e-3, micro_batch_size=3, loop_weighting="exit-pdf")
    with Trainer(copy.deepcopy(model), config) as trainer:
        metrics = trainer.forward_backward(samples)
        grads = {k: v.detach().float().cpu().clone() for k, v in trainer.gradients().items()}
    return metrics, grads


def test_loop_weighting_on_cuda_matches_cpu_and_repeats_bit_for_bit():
    model = build(tiny_config(), seed=3)
    with torch.no_grad():
        model.model.early_exit_gate.weight.normal_(0.0, 0.5)
    samples = make_samples(model, 6, seed=11)
    cpu_metrics, cpu_grads = _run(model, samples, "cpu")
    metrics, grads = _run(model, samples, "cuda")
    again, grads_again = _run(model, samples, "cuda")
    assert metrics["loss"] == pytest.approx(cpu_metrics["loss"], abs=0.05)
    assert metrics["loop_tokens"] == cpu_metrics["loop_tokens"]
    assert metrics["loop_logprob_mean"] == pytest.approx(cpu_metrics["loop_logprob_mean"], abs=0.05)
    for name, g in grads.items():
        ref = cpu_grads[name]
        assert (g - ref).norm() / ref.norm().clamp(min=1e-12) < 0.1, name
        assert torch.equal(g, grads_again[name]), name
    assert again["loss"] == metrics["loss"]


def test_train_update_on_cuda_takes_its_steps():
    from ouro_cli.trainer import Trainer, TrainerConfig

    model = build(tiny_config(), seed=3)
    samples = make_samples(model, 6, seed=11)
    with Trainer(copy.deepcopy(model), TrainerConfig(device="cuda", lr=1e-3)) as trainer:
        out = trainer.train_update([samples[:3], samples[3:]], epochs=2)
        assert (out["optimizer_steps"], trainer.steps_taken) == (4, 4) and out["step_applied"]
