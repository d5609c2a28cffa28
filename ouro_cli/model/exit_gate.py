"""The exit gate's distribution over loops (docs/model.md §2).

`λ_t = sigmoid(gate(h_t))`; `p_t = λ_t · Π_{s<t}(1 − λ_s)` for t < T and
`p_T = Π_{s<T}(1 − λ_s)`, so the distribution always sums to one and the CDF
reaches 1 at t = T whatever the gate says there.
"""

from __future__ import annotations

import torch


def exit_distribution(lambdas: torch.Tensor) -> torch.Tensor:
    """lambdas [..., T] (fp32 recommended) -> p [..., T], summing to 1 over the last axis."""
    survive = torch.cumprod(1.0 - lambdas, dim=-1)
    before = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], dim=-1)
    p = lambdas * before
    return torch.cat([p[..., :-1], before[..., -1:]], dim=-1)


def exit_cdf(lambdas: torch.Tensor) -> torch.Tensor:
    """Cumulative exit probability per loop; the last entry is 1 up to rounding."""
    return torch.cumsum(exit_distribution(lambdas), dim=-1)


def cdf_step(
    cdf_prev: torch.Tensor, survive_prev: torch.Tensor, lam: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Incremental form for decoding one loop at a time (t < T).

    Given CDF_{t-1} and S_{t-1} = Π_{s<t}(1 − λ_s), returns (CDF_t, S_t). At t = 1 pass
    cdf_prev = 0 and survive_prev = 1. It agrees with `exit_cdf` term by term.
    """
    return cdf_prev + lam * survive_prev, survive_prev * (1.0 - lam)
