"""Token sampling and log-probabilities exactly as docs/model.md §4 defines them.

processed = log_softmax over fp32 logits / temperature, restricted by top-k then
top-p and renormalised; the sampled token is drawn from exactly that distribution,
and its processed log-probability is what the trainer recomputes as
`log_softmax(logits / temperature)` when top_k = -1 and top_p = 1.
raw = fp32 log_softmax of the unscaled logits.

Each request owns a seeded `RequestRng` (request_rng.py); a row's draw uses only its
own stream and its own logits (Gumbel-max via exponential noise: argmax p / E), so a
request samples the same tokens whatever it is batched with. Temperature 0 is
greedy, and its processed distribution is the point mass on the argmax (logprob 0).
The log-softmax is pointwise.log_softmax, the trainer's: callers run these under the
model's execution settings (in exact mode a batch-invariant one, docs/exact.md).
"""

from __future__ import annotations

import torch

from ouro_cli.host_to_device import to_device
from ouro_cli.model import pointwise

from .request_rng import RequestRng, exponential, next_keys


class SamplingBatch:
    """Per-row sampling settings of one step, as device tensors plus host-side flags
    (so that deciding which transforms to run never waits on the device)."""

    def __init__(
        self,
        temperatures: list[float],
        top_ks: list[int],
        top_ps: list[float],
        rngs: list[RequestRng],
        device: torch.device,
    ) -> None:
        self.greedy = [t <= 0 for t in temperatures]
        self.rngs = rngs
        self.temperature = to_device([t if t > 0 else 1.0 for t in temperatures], torch.float32, device)
        self.top_k = to_device(top_ks, torch.long, device)
        self.top_p = to_device(top_ps, torch.float32, device)
        self.any_top_k = any(k > 0 for k in top_ks)
        self.any_top_p = any(p < 1.0 for p in top_ps)


def processed_logprobs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B,V] (any dtype) -> fp32 log-probabilities [B,V] of the distribution sampled from."""
    x = logits.float() / batch.temperature[:, None]
    vocab = x.shape[-1]
    if batch.any_top_k:
        use_k = (batch.top_k > 0) & (batch.top_k < vocab)
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (batch.top_k.clamp(1, vocab) - 1)[:, None])
        x = torch.where(use_k[:, None] & (x < kth), torch.full_like(x, -torch.inf), x)
    if batch.any_top_p:
        probs = torch.softmax(x, dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly ahead of each token
        drop_sorted = (before >= batch.top_p[:, None]) & (batch.top_p < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        x = torch.where(drop, torch.full_like(x, -torch.inf), x)
    return pointwise.log_softmax(x)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return pointwise.log_softmax(logits.float())


def sample(logprobs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token per row from the processed distribution `logprobs` [B,V] -> [B] (long).

    Greedy rows take the argmax and draw nothing from their stream."""
    keys = next_keys(batch.rngs, [not greedy for greedy in batch.greedy])
    scores = logprobs.exp() / exponential(keys, logprobs.shape[-1], logprobs.device)
    if any(batch.greedy):
        greedy = to_device(batch.greedy, torch.bool, logprobs.device)
        scores = torch.where(greedy[:, None], logprobs, scores)
    return torch.argmax(scores, dim=-1)


def token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Log-probability of each row's sampled token; a greedy row sampled a point mass (0)."""
    picked = logprobs.gather(1, tokens[:, None]).squeeze(1)
    if any(batch.greedy):
        picked = torch.where(to_device(batch.greedy, torch.bool, picked.device), torch.zeros_like(picked), picked)
    return picked
