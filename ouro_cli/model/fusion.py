"""Fused projection weights for inference: q/k/v as one matrix, gate/up as another.

Decoding multiplies a handful of rows by each weight matrix, so one projection splits
into too few output tiles to keep the GPU reading memory. One [q;k;v] and one [gate;up]
matrix give each GEMM more tiles and two launches per layer and loop instead of five
(why: docs/performance.md#decode).

The HF parameters stay what they were to everything else: `q_proj.weight` etc. become
views into the fused matrix (same names, shapes, values), so weight publication, which
copies into the parameters in place, updates the fused matrix, and CUDA graphs captured
on it see every version. The math is unchanged (each output is the same dot product);
only the GEMM's tiling, and with it low-order rounding, differs.
"""

from __future__ import annotations

import torch
from torch import nn

from .ouro import OuroForCausalLM


@torch.no_grad()
def fuse_projections(model: OuroForCausalLM) -> None:
    """Make every layer's q/k/v and gate/up weights views of one matrix each (in place)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_weight is None:
            attn.qkv_weight = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        if mlp.gate_up_weight is None:
            mlp.gate_up_weight = _fuse([mlp.gate_proj, mlp.up_proj])


def _fuse(linears: list[nn.Linear]) -> torch.Tensor:
    fused = torch.cat([lin.weight for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start : start + rows], requires_grad=lin.weight.requires_grad)
        start += rows
    return fused
