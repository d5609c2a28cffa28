"""Rollout-like samples for trainer tests (shared by tests and their subprocess workers).

Rollout log-probabilities are the model's own replayed values plus noise, so ratios
spread on both sides of the clip range and both branches of the surrogate are used.
Kept free of Megatron imports: worker scripts import it at top level, and Megatron's
checkpoint saver re-imports a script's top level in a helper process.
"""

from __future__ import annotations

import random

import torch


def make_samples(
    model,
    n: int,
    seed: int,
    *,
    temperature: float = 1.0,
    noise: float = 0.4,
    max_prompt: int = 7,
    max_response: int = 7,
):
    from ouro_cli.trainer.batching import Sample

    g = random.Random(seed)
    T = model.config.num_loops
    V = model.config.vocab_size
    out = []
    for _ in range(n):
        m, k = g.randint(1, max_prompt), g.randint(1, max_response)
        prompt = [g.randrange(V) for _ in range(m)]
        response = [g.randrange(V) for _ in range(k)]
        exits = [T] + [g.randint(1, T) for _ in range(k - 1)]
        depths = torch.tensor([[T] * m + exits[1:] + [T]])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response]), depths).float()
        logp = torch.log_softmax(logits[0, m - 1 : m + k - 1] / temperature, -1)
        lp = logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        rollout = [float(x) + g.uniform(-noise, noise) for x in lp]
        out.append(Sample(prompt, response, exits, rollout, g.uniform(-1.5, 1.5), temperature))
    return out


def forward_backward_on_cpu(model, samples, **options):
    """One CPU Trainer's metrics and gradients for `samples` (a copy of `model`, lr 1e-3,
    `options` for TrainerConfig); the trainer is closed afterwards."""
    import copy

    from ouro_cli.trainer import Trainer, TrainerConfig

    trainer = Trainer(copy.deepcopy(model), TrainerConfig(device="cpu", lr=1e-3, **options))
    try:
        metrics = trainer.forward_backward(samples)
        grads = {k: v.detach().clone() for k, v in trainer.gradients().items()}
    finally:
        trainer.close()
    return metrics, grads
