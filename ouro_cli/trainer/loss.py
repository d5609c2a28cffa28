"""The GRPO objective on replayed log-probabilities (docs/model.md §3–4).

For each response token: new = log_softmax(logits / temperature)[token] from the
trainer's replay, old = the rollout engine's log-probability of the same token,
ratio = exp(new − old), and the clipped surrogate

    loss_tok = −min(ratio · A, clip(ratio, 1 − ε_low, 1 + ε_high) · A)

with the sample's advantage A. There is no KL term, no reference model and no critic:
the rollouts are on-policy up to the replay mismatch (reported), and the asymmetric
clip (ε_high > ε_low) leaves room for low-probability tokens to grow. The per-token
terms are summed with weights that implement token-mean or sequence-mean over the
global batch (batching.loss_weights).

Log-softmax runs in fp32 over the full vocabulary, only at the scored positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ouro_cli.model import pointwise


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] at the scoring positions -> (log p(target) [N], log_softmax [N, V]), fp32."""
    logp = pointwise.log_softmax(logits.float() / temperatures[:, None])  # the engine's (exact mode: docs/exact.md)
    return logp.gather(-1, targets[:, None]).squeeze(-1), logp


@dataclass
class TokenTerms:
    loss: torch.Tensor  # [N] per-token surrogate loss (differentiable)
    ratio: torch.Tensor  # [N] detached
    clipped: torch.Tensor  # [N] bool: the clip bound was the active (gradient-free) branch


def clipped_surrogate(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      eps_low: float, eps_high: float) -> TokenTerms:
    ratio = torch.exp(new_logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    r = ratio.detach()
    active = ((advantages > 0) & (r > 1.0 + eps_high)) | ((advantages < 0) & (r < 1.0 - eps_low))
    return TokenTerms(loss, r, active)


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """Per-row entropy of the (temperature-scaled) distribution, no grad."""
    with torch.no_grad():
        p = logp.exp()
        return -torch.xlogy(p, p).sum(-1)  # 0·log 0 = 0 where a probability underflows
