"""Importance-sampling correction of the rollout-trainer mismatch (`--is-correction`, docs/exact.md §5).

Outside exact mode the engine samples from π_rollout, which differs from the trainer's
π_train at the same weights by rounding (docs/exact.md §1). GRPO's ratio exp(new − rollout)
then mixes that mismatch into the policy ratio. A correction separates the two. Both of
its parts are taken against the update's *first* policy π_first: the trainer at the weights
the engine sampled with, before the update's first optimizer step (`first`, the replay's
logprobs at those weights, which the trainer computes before that step when an update
takes several; Trainer.train_update):

- the PPO ratio exp(new − first) (`reference` = first): from the second step on it is the
  policy's move since sampling, which the clip bounds; at the first step it is 1 in value
  with gradient ∇ log π;
- r = π_first / π_rollout per token, detached, weighs or masks each token's loss (`weight`):
  the engine-vs-trainer mismatch alone, without the policy's drift over the update's steps.

    none      weight 1; reference = the rollout's logprobs (the uncorrected objective)
    tis       weight min(r, HIGH)                        truncated importance sampling
    mis       weight 1 if LOW <= r <= HIGH, else 0       masked IS (IcePop-style token masking)
    geo-mask  weight 1 if LOW <= exp(mean log r) <= HIGH over the token's sequence, else 0

Masked tokens keep their share of the loss's normalisation (they add 0), so masking does
not re-weigh the tokens kept. `--is-bounds LOW HIGH` defaults to 0.5 2.0 (TIS uses HIGH
alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("none", "tis", "mis", "geo-mask")
DEFAULT_BOUNDS = (0.5, 2.0)


@dataclass
class Correction:
    weight: torch.Tensor  # [N] detached factor on each token's loss
    reference: torch.Tensor  # [N] the logprobs the PPO ratio is taken against

    @property
    def masked(self) -> torch.Tensor:
        return self.weight == 0


def correct(
    mode: str,
    bounds: tuple[float, float] | list[float],
    new: torch.Tensor,
    rollout: torch.Tensor,
    sample_ids: torch.Tensor,
    first: torch.Tensor | None = None,
) -> Correction:
    """The correction of N scored tokens: `new` the trainer's logprobs, `rollout` the engine's,
    `first` the trainer's under the update's first policy (None: this is the update's only
    step, so `new` is that policy's), `sample_ids` [N] which sample (sequence) each token
    belongs to, each sample's tokens consecutive (as batching.build_micro_batch lays them out)."""
    first = new.detach() if first is None else first
    if mode == "none":
        return Correction(torch.ones_like(first), rollout)
    low, high = bounds
    log_ratio = first - rollout
    if mode == "tis":
        weight = torch.exp(log_ratio).clamp(max=high)
    elif mode == "mis":
        ratio = torch.exp(log_ratio)
        weight = ((ratio >= low) & (ratio <= high)).to(first.dtype)
    elif mode == "geo-mask":  # a sample's tokens are consecutive; split, not index_add (deterministic on CUDA)
        counts = torch.unique_consecutive(sample_ids, return_counts=True)[1]
        means = torch.stack([part.mean() for part in torch.split(log_ratio, counts.tolist())])
        geo = torch.exp(means).repeat_interleave(counts)
        weight = ((geo >= low) & (geo <= high)).to(first.dtype)
    else:
        raise ValueError(f"unknown is_correction {mode!r}; expected one of {', '.join(MODES)}")
    return Correction(weight, first)
