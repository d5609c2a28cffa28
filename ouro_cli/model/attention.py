"""Dense attention over whole sequences: padding, packing (document masking) and causality.

Used by the full-sequence forward (trainer replay, engine prefill, references). The
mask always lets a query see itself, so padded rows never become all-masked (which
would turn softmax into NaN and poison gradients through `torch.where`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ouro_cli.errors import SettingError

from . import exact, pointwise


@dataclass
class SequenceLayout:
    """Where each position sits: its RoPE position and which positions it may attend to.

    `mask` is None for plain causal attention over unpadded, unpacked rows, else a
    boolean [B, 1, S, S] (True = attend).
    """

    position_ids: torch.Tensor
    mask: torch.Tensor | None
    valid: torch.Tensor | None

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> SequenceLayout:
        b, s = input_ids.shape
        device = input_ids.device
        if attention_mask is None and document_ids is None:
            if position_ids is None:
                position_ids = torch.arange(s, device=device).expand(b, s)
            return cls(position_ids, None, None)
        valid = torch.ones(b, s, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
        docs = torch.zeros(b, s, dtype=torch.long, device=device) if document_ids is None else document_ids.long()
        docs = torch.where(valid, docs, torch.full_like(docs, -1))
        if position_ids is None:
            position_ids = _positions_within_documents(docs, valid)
        idx = torch.arange(s, device=device)
        causal = idx[None, :] <= idx[:, None]
        same_doc = docs[:, :, None] == docs[:, None, :]
        mask = same_doc & causal[None] & valid[:, None, :]
        mask = mask | torch.eye(s, dtype=torch.bool, device=device)[None]
        return cls(position_ids, mask[:, None], valid)


def _positions_within_documents(docs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... restarting at every document start; padding gets position 0."""
    s = docs.shape[1]
    idx = torch.arange(s, device=docs.device).expand_as(docs)
    starts = torch.ones_like(valid)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    start_idx = torch.where(starts & valid, idx, torch.zeros_like(idx))
    start_idx = torch.cummax(start_idx, dim=1).values
    return torch.where(valid, idx - start_idx, torch.zeros_like(idx))


PAGED_NEEDS_CUDA = ("--replay-attention paged runs a Triton kernel: it needs CUDA (or the Triton interpreter, "
                    "TRITON_INTERPRET=1)")


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D]; scale head_dim**-0.5; GQA by head groups.

    SDPA, or with the model's `replay_attention="paged"` (ouro_cli/settings.py) every query
    through the decode attention kernel, in its reduction order (kernels/replay_attention.py);
    that mode never runs inside a compiled region (`compile_layers` leaves them out for it).
    In exact mode (docs/exact.md) the decode kernel's order on CUDA, exact.dense_attention's
    (the CPU decode step's) elsewhere."""
    path = pointwise.active().replay_attention_on(q.device.type)
    if path == "exact":
        return exact.dense_attention(q, k, v, mask, sdpa_attention)
    if not torch.compiler.is_compiling() and path == "paged":
        from ouro_cli.kernels import interpreted

        if not q.is_cuda and not interpreted():
            raise SettingError(PAGED_NEEDS_CUDA)
        from ouro_cli.kernels.replay_attention import paged_replay_attention

        return paged_replay_attention(q, k, v, mask, sdpa_attention)
    return sdpa_attention(q, k, v, mask)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """dense_attention through PyTorch's scaled_dot_product_attention (the default)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return o.transpose(1, 2)
