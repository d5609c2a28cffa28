"""One Ouro decoder layer and its parts (docs/model.md §2), written once for every caller.

The layer does not own its attention over past tokens: it computes q, k, v for the
tokens it is given and hands them to an `attend(q, k, v)` callable supplied by the
caller. The whole-sequence forward (`OuroForCausalLM.forward`: the trainer's replay, the
engine's prefill) plugs in dense attention there and the engine's decode step attention over
its paged KV cache, so the projections, norms, RoPE and MLP exist exactly once. The K/V
a layer hands on are the cache's: rounded to fp8 here, for every caller, when the settings ask
for an fp8 cache (model/kv_quant.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ouro_cli.settings import active_settings

from . import kv_quant, pointwise
from .config import OuroConfig
from .matmul import linear

# attend(q [B,S,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,D]) -> o [B,S,Hq,D], q and k rotated (RoPE).
# With an fp8 KV cache the layer rounds K/V (kv_quant.round_trip) before attending, unless the
# attend function has `packs_kv` set: it packs the K/V into the cache itself and attends only
# over what it packed, and packing rounds as the round trip does (kv_quant.unpack(pack(x)) is
# round_trip(x)), so it attends over the same values without the layer's pass. (A row whose
# largest value the rounding moves onto a binade edge is packed as another pair of codes and
# exponent for those values, twice the codes at 2^(k-1); the decode kernel's dots scale by
# powers of two exactly, so its outputs keep their bits: kernels/decode_attention.py.)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def project(x: torch.Tensor, fused: torch.Tensor | None, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """x times each of `weights` (projections of one input: q, k, v or gate, up).

    One product of their stacked matrix where it exists already (`fused`: the engine's,
    model/fusion.py) and in exact mode on CUDA, stacked per call (exact.linear keeps the
    separate weights for backward, not the stack); one product per weight elsewhere, so the
    compiled layer regions do not keep the stack for backward. Exact mode's fixed-tile kernel
    gives every column the same bits either way (docs/exact.md §2).
    why: docs/performance.md#exact-mode"""
    sizes = [w.shape[0] for w in weights]
    if fused is not None:
        return linear(x, fused).split(sizes, -1)
    if x.is_cuda and active_settings().exact:
        return linear(x, weights).split(sizes, -1)
    return tuple(linear(x, w) for w in weights)


class RMSNorm(nn.Module):
    """`w * (x_wide * rsqrt(mean(x_wide^2) + eps)).to(x.dtype)`, x_wide at least fp32
    (docs/model.md §2)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pointwise.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Default RoPE, rotate-half convention; cos/sin in fp32, cast to the activation dtype.

    The inverse frequencies are recomputed in fp32 on every call rather than kept as a
    buffer: checkpoints never store them, and `model.to(bfloat16)` cannot degrade them.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, device=position_ids.device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        freqs = position_ids.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.dim_per_head
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.qkv_weight: torch.Tensor | None = None  # set by fusion.fuse_projections

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = project(x, self.qkv_weight, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        q, k = pointwise.rotary(q, k, cos, sin)
        if active_settings().fp8_kv and not getattr(attend, "packs_kv", False):
            # what the engine's cache holds, in the replay as in the engine (`Attend`)
            k, v = kv_quant.round_trip(k), kv_quant.round_trip(v)
        o = attend(q, k, v)
        return linear(o.reshape(b, s, self.num_heads * self.head_dim), self.o_proj.weight)


class MLP(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fusion.fuse_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_up_weight, (self.gate_proj.weight, self.up_proj.weight))
        return linear(pointwise.silu_mul(gate, up), self.down_proj.weight)


class DecoderLayer(nn.Module):
    """Sandwich-norm layer: `post_attention_layernorm` is the pre-MLP norm (as in Llama);
    the `_2` norms are applied to each sublayer's output before the residual add."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)
        self._eps = eps

    def forward(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        next_norm_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer given `x = input_layernorm(h)`, which the caller computed (in a stack: the
        previous layer's closing kernel). Returns (h', rms_norm(h', next_norm_weight)): the next
        layer's input norm, or `model.norm` after the last layer, comes out of the same fused
        kernel as the closing add. Without `next_norm_weight` the second value is None.

        h + norm_2(attn(norm(h))), then h + norm_2(mlp(norm(h))); each closing add runs fused
        with the norm that follows it.
        """
        a = self.self_attn(x, cos, sin, attend)
        h, x = pointwise.add_rms_norm_then_norm(
            h, a, self.input_layernorm_2.weight, self.post_attention_layernorm.weight, self._eps
        )
        m = self.mlp(x)
        if next_norm_weight is None:
            return pointwise.add_rms_norm(h, m, self.post_attention_layernorm_2.weight, self._eps), None
        return pointwise.add_rms_norm_then_norm(
            h, m, self.post_attention_layernorm_2.weight, next_norm_weight, self._eps
        )
