"""The GRPO objective on replayed log-probabilities (docs/model.md §3–4).

For each response token: new = log_softmax(logits / temperature)[token] from the
trainer's replay, old = the rollout engine's log-probability of the same token (under
`--is-correction`, the trainer's own under the update's first policy: is_correction.py),
ratio = exp(clamp(new − old, ±B)), and the clipped surrogate

    loss_tok = −min(ratio · A, clip(ratio, 1 − ε_low, 1 + ε_high) · A)
    loss_tok = min(loss_tok, −c · A)        for A < 0, with the dual clip c (`clip_ratio_c`)

with the sample's advantage A and B = `log_ratio_bound`. There is no KL term, no reference model and no critic:
the rollouts are on-policy up to the replay mismatch (reported), and the asymmetric
clip (ε_high > ε_low) leaves room for low-probability tokens to grow. The per-token
terms are summed with weights that implement token-mean or sequence-mean over the
global batch (batching.loss_weights).

Log-softmax runs in fp32 over the full vocabulary, only at the scored positions.

Loop weighting (`loop_weighting`, docs/grpo.md): the ratio and its clip stay on the exit
loop's log-probability (the distribution the engine sampled), while the gradient follows
Σ_t ω_t ∇ log π^(t) over the loops t ≤ d the token executed (`weighted_score`); `loop_weights`
gives ω. With `exit`, ω is one-hot at t = d and nothing extra is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ouro_cli.model import pointwise

from .config import LOG_RATIO_BOUND


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] at the scoring positions -> (log p(target) [N], log_softmax [N, V]), fp32."""
    logp = pointwise.log_softmax(logits.float() / temperatures[:, None])  # the engine's (exact mode: docs/exact.md)
    return logp.gather(-1, targets[:, None]).squeeze(-1), logp


@dataclass
class TokenTerms:
    loss: torch.Tensor  # [N] per-token surrogate loss (differentiable)
    ratio: torch.Tensor  # [N] detached
    clipped: torch.Tensor  # [N] bool: the clip bound was the active (gradient-free) branch


def clipped_surrogate(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    log_ratio_bound: float = LOG_RATIO_BOUND,
    clip_ratio_c: float | None = None,
) -> TokenTerms:
    """The clipped surrogate per token. The log-ratio is clamped to ±`log_ratio_bound` before it is
    exponentiated (inside the bound the values and gradients are those of the plain ratio; outside
    it the ratio is constant, its gradient 0). `clip_ratio_c` (dual clip, A < 0 only) caps a
    token's loss at −c·A: beyond r > c the term is constant and takes no gradient."""
    ratio = torch.exp(torch.clamp(new_logprobs - old_logprobs, -log_ratio_bound, log_ratio_bound))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    r = ratio.detach()
    active = ((advantages > 0) & (r > 1.0 + eps_high)) | ((advantages < 0) & (r < 1.0 - eps_low))
    if clip_ratio_c is not None:
        negative = advantages < 0
        loss = torch.where(negative, torch.minimum(loss, -clip_ratio_c * advantages), loss)
        active = active | (negative & (r > clip_ratio_c))
    return TokenTerms(loss, r, active)


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """Per-row entropy of the (temperature-scaled) distribution, no grad."""
    with torch.no_grad():
        p = logp.exp()
        return -torch.xlogy(p, p).sum(-1)  # 0·log 0 = 0 where a probability underflows


def loop_weights(
    depths: torch.Tensor,
    loops: int,
    scheme: str,
    *,
    alpha: float = 1.0,
    lambdas: torch.Tensor | None = None,
    num_loops: int | None = None,
) -> torch.Tensor:
    """ω [N, loops] over the loops t = 1..loops for tokens that executed `depths` [N] loops: zero
    for t > d, summing to 1 over t ≤ d, no gradient.

    uniform: 1/d. progressive: t^α / Σ_{s≤d} s^α. exit-pdf: the exit gate's distribution
    p_t = λ_t Π_{s<t}(1 − λ_s) (t < T), p_T = Π_{s<T}(1 − λ_s), from `lambdas` [N, loops] (the
    gate at each loop's exit state; T = `num_loops`), renormalised over t ≤ d; a token whose
    executed loops all have p_t = 0 keeps its exit loop (weight 1 at t = d). exit: one-hot at d.
    """
    with torch.no_grad():
        t = torch.arange(1, loops + 1, device=depths.device)
        executed = t[None, :] <= depths[:, None]
        if scheme == "exit":
            raw = (t[None, :] == depths[:, None]).float()
        elif scheme == "uniform":
            raw = executed.float()
        elif scheme == "progressive":
            raw = t.double().pow(alpha).float()[None, :].expand(len(depths), loops) * executed
        elif scheme == "exit-pdf":
            if lambdas is None or num_loops is None:
                raise ValueError("exit-pdf weighting needs the gate's lambdas and the model's loop count")
            lam = lambdas.float()
            survive = torch.cumprod(1.0 - lam, dim=-1)
            before = torch.cat([torch.ones_like(survive[:, :1]), survive[:, :-1]], dim=-1)
            pdf = torch.where(t[None, :] < num_loops, lam * before, before)
            raw = pdf * executed
            empty = raw.sum(-1, keepdim=True) == 0
            raw = torch.where(empty, (t[None, :] == depths[:, None]).float(), raw)
        else:
            raise ValueError(f"unknown loop weighting {scheme!r}")
        return raw / raw.sum(-1, keepdim=True)


def weighted_score(exit_logprobs: torch.Tensor, loop_logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The log-probability the surrogate is fed under loop weighting: its value is the exit loop's
    (`exit_logprobs` [N], bit for bit: the ratio, its clip and the loss value do not change), its
    gradient Σ_t ω_t ∇ log π^(t) (`loop_logprobs` [N, L], `weights` [N, L], no gradient)."""
    weighted = (weights * loop_logprobs).sum(-1)
    return exit_logprobs.detach() + (weighted - weighted.detach())
