"""The plain formulas of a layer's elementwise math: RMSNorm (alone, closing a residual add,
and followed by the next norm), RoPE and SwiGLU's silu(gate)·up (docs/model.md §2).

These are Ouro's functions as eager torch computes them, with the roundings docs/model.md
§2 spells out. model/pointwise.py runs them (eager, compiled, or exact mode's twins in
their place) and kernels/exact_rows.py differentiates them for its kernels' backward
passes, so both see one definition. This module imports nothing else from the package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`w * (x_wide * rsqrt(mean(x_wide^2) + eps)).to(x.dtype)`, x_wide at least fp32 (fp64 stays
    fp64, which lets tests compare against an fp64 reference)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h + rms_norm(x)`: a sandwich norm closing a sublayer into the residual stream."""
    return h + rms_norm(x, weight, eps)


def add_rms_norm_then_norm(
    h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`h' = h + rms_norm(x, weight)`, `rms_norm(h', next_weight)`)."""
    h = h + rms_norm(x, weight, eps)
    return h, rms_norm(h, next_weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (rotate-half) on q [B,S,Hq,D] and k [B,S,Hkv,D]; cos/sin [B,S,D]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up
