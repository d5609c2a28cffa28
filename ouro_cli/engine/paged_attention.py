"""Decode attention over the paged KV cache, in plain torch, invariant to batch composition.

A row's result must not depend on which other rows share its step (docs/model.md §4: any
request replays bit for bit; the tests compare max_num_seqs 1 vs 4). Padding every
row to the batch's longest context would change the reduction length of softmax and
of p·V, and with it the rounding. So the context is cut into fixed-size chunks at
absolute positions and combined with an online softmax, chunk after chunk: a chunk
past a row's end is fully masked and its combine step is an exact no-op (scale 1,
contribution 0), and each chunk has the same shape whatever the batch. The result
for a row is therefore the same bits whether it runs alone or with longer rows.

Scores, softmax and the accumulator are fp32; the scale multiplies the fp32 scores (as
flash attention does), so q is never rounded after scaling. With bf16 K/V on CUDA the two batched
matmuls read bf16 and write fp32 (`out_dtype`), with P rounded to bf16 for P·V as
flash attention does; elsewhere K/V are upcast. An fp8 cache's packed rows are unpacked
after the gather (model/kv_quant.py), into the model's dtype on CUDA, which holds every fp8
value times its power-of-two scale exactly. The head-major cache layout makes a gathered
chunk [Hkv, B, n, D], so GQA is a batched matmul over (Hkv, B) with the query heads of a
group as rows, and nothing is transposed or copied besides the gather.
"""

from __future__ import annotations

import torch

from ouro_cli.model import kv_quant


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.float32:
        return torch.bmm(a, b.float())
    if a.is_cuda:
        return torch.bmm(a, b.to(a.dtype), out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def decode_attention(
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    ctx_slots: torch.Tensor,
    valid: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """q [B, Hq, D] for one new token per row; k_plane/v_plane [Hkv, slots, R] (one plane of one
    layer, rows as the cache stores them: D values or packed fp8); ctx_slots/valid [B, C·chunk]
    -> o [B, Hq, D]. Scale head_dim**-0.5."""
    b, hq, d = q.shape
    hkv = k_plane.shape[0]
    g = hq // hkv
    # [Hkv·B, G, D]: row (h, b) holds the G query heads of kv head h for batch row b
    qg = q.view(b, hkv, g, d).transpose(0, 1).reshape(hkv * b, g, d)
    scale = d**-0.5
    packed = k_plane.dtype == torch.uint8
    kv_dtype = (q.dtype if packed else k_plane.dtype) if q.is_cuda else torch.float32
    qg = qg.to(kv_dtype)
    m = torch.full((hkv * b, g, 1), -torch.inf, device=q.device)
    l_sum = torch.zeros_like(m)
    acc = torch.zeros(hkv * b, g, d, device=q.device)
    for start in range(0, ctx_slots.shape[1], chunk):
        slots = ctx_slots[:, start : start + chunk]
        n = slots.shape[1]
        mask = valid[:, start : start + chunk].repeat(hkv, 1)[:, None, :]  # [Hkv·B, 1, n]
        flat = slots.reshape(-1)
        k = kv_quant.values(k_plane.index_select(1, flat), kv_dtype, d).view(hkv * b, n, d)
        v = kv_quant.values(v_plane.index_select(1, flat), kv_dtype, d).view(hkv * b, n, d)
        s = torch.where(mask, _bmm_fp32(qg, k.transpose(1, 2)) * scale, -torch.inf)  # [Hkv·B, G, n]
        m_c = s.amax(-1, keepdim=True)
        m_c_safe = torch.where(torch.isinf(m_c), torch.zeros_like(m_c), m_c)
        p = torch.exp(s - m_c_safe)
        m_new = torch.maximum(m, m_c)
        old, new = torch.exp(m - m_new), torch.exp(m_c - m_new)  # exp(-inf) = 0: an empty side drops out
        acc = acc * old + _bmm_fp32(p.to(kv_dtype), v) * new
        l_sum = l_sum * old + p.sum(-1, keepdim=True) * new
        m = m_new
    o = (acc / l_sum).view(hkv, b, g, d).transpose(0, 1).reshape(b, hq, d)
    return o.to(q.dtype)
