"""Triton kernels of one decode layer-loop: write this loop's K/V, then attend over the paged plane.

`paged_decode_attention` computes what paged_attention.decode_attention computes (the
reference), without its gather copies and without one kernel per chunk and operation.
One program owns a (batch row, kv head) pair and the G = Hq/Hkv query heads of its
group. It walks the row's own context, tiles of BLOCK positions at absolute offsets
0, BLOCK, 2·BLOCK, … up to the row's length, reads K/V straight from the plane through
the row's slot ids, and folds each tile into an fp32 online softmax. The loop bound is
the row's length, so a row computes the same bits whatever its batch-mates and whatever
the width of the slot table (the batch-invariance the engine promises, OURO.md §4).

Numerics follow the reference: Q·Kᵀ accumulates in fp32 and is scaled there (q is not
rounded after scaling, as in flash attention), P·V accumulates in fp32 with P rounded to the KV dtype (bf16 on the GPU, as flash
attention does); fp32 K/V use full-precision (IEEE, not TF32) dots. The group's G query
heads are padded to 16 rows because tl.dot needs M >= 16; the padding rows load zeros and
are never stored. Results match the reference to rounding, not bit for bit (the
reductions run in another order).

`write_kv_with_carry` is runner.py's KV write of a loop in one kernel: rows still active
write their new K/V into plane t at their slot; rows that have exited copy their plane
t-1 entry instead, which builds the last-exited layout of OURO.md §3 as the step runs.

Both are CUDA-graph capturable: no host reads, and the grids depend only on shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _decode_attention_kernel(Q, K, V, SLOTS, LENGTHS, OUT, scale,
                             stride_qb, stride_qh, stride_kh, stride_ks, stride_sb, stride_ob, stride_oh,
                             G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    gd_ok = (g < G)[:, None] & (d < D)[None, :]
    heads = h * G + g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gd_ok, other=0.0)
    q = q.to(K.dtype.element_ty)
    length = tl.load(LENGTHS + b).to(tl.int32)
    m = tl.full([GP], float("-inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BLOCK_D], tl.float32)
    kv_head = K + h * stride_kh
    v_head = V + h * stride_kh
    for start in range(0, length, BLOCK):
        n = start + tl.arange(0, BLOCK)
        n_ok = n < length
        slot = tl.load(SLOTS + b * stride_sb + n, mask=n_ok, other=0).to(tl.int64)
        nd_ok = n_ok[:, None] & (d < D)[None, :]
        offs = slot[:, None] * stride_ks + d[None, :]
        k = tl.load(kv_head + offs, mask=nd_ok, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_ok[None, :], s * scale, float("-inf"))  # [GP, BLOCK]; every tile holds >= 1 valid position
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)  # exp(-inf) = 0 on the first tile
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_head + offs, mask=nd_ok, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(V.dtype.element_ty), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(V.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    o = acc / l_sum[:, None]
    tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :], o.to(OUT.dtype.element_ty), mask=gd_ok)


def paged_decode_attention(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, ctx_slots: torch.Tensor,
                           lengths: torch.Tensor, block: int = 64) -> torch.Tensor:
    """q [B, Hq, D] (one new token per row); k_plane/v_plane [Hkv, slots, D] (one plane of one
    layer); ctx_slots [B, W] slot ids of positions 0..W-1; lengths [B] (1 <= length <= W: a row
    attends to its first `length` positions) -> o [B, Hq, D] in q's dtype. Scale head_dim**-0.5."""
    b, hq, d = q.shape
    hkv = k_plane.shape[0]
    assert hq % hkv == 0 and k_plane.shape == v_plane.shape and k_plane.stride() == v_plane.stride()
    assert k_plane.stride(-1) == 1 and block >= 16
    q, ctx_slots = _unit_last_stride(q), _unit_last_stride(ctx_slots)
    g = hq // hkv
    o = torch.empty_like(q)
    _decode_attention_kernel[(b, hkv)](
        q, k_plane, v_plane, ctx_slots, lengths, o, d**-0.5,
        q.stride(0), q.stride(1), k_plane.stride(0), k_plane.stride(1), ctx_slots.stride(0), o.stride(0), o.stride(1),
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK=block, IEEE=k_plane.dtype == torch.float32, num_warps=4)
    return o


@triton.jit
def _write_kv_kernel(K_T, V_T, K_PREV, V_PREV, SLOTS, K_NEW, V_NEW, ACTIVE,
                     stride_ph, stride_ps, stride_kb, stride_kh, stride_vb, stride_vh,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_PREV: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h < H)[:, None] & (d < D)[None, :]
    slot = tl.load(SLOTS + b).to(tl.int64)
    dst = slot * stride_ps + h[:, None] * stride_ph + d[None, :]
    k = tl.load(K_NEW + b * stride_kb + h[:, None] * stride_kh + d[None, :], mask=ok).to(K_T.dtype.element_ty)
    v = tl.load(V_NEW + b * stride_vb + h[:, None] * stride_vh + d[None, :], mask=ok).to(V_T.dtype.element_ty)
    if HAS_PREV:  # an exited row carries plane t-1 forward instead
        carry = tl.load(ACTIVE + b) == 0
        k = tl.where(carry, tl.load(K_PREV + dst, mask=ok), k)
        v = tl.where(carry, tl.load(V_PREV + dst, mask=ok), v)
    tl.store(K_T + dst, k, mask=ok)
    tl.store(V_T + dst, v, mask=ok)


def write_kv_with_carry(k_plane_t: torch.Tensor, v_plane_t: torch.Tensor, k_prev_plane: torch.Tensor | None,
                        v_prev_plane: torch.Tensor | None, slots: torch.Tensor, k_new: torch.Tensor,
                        v_new: torch.Tensor, active: torch.Tensor) -> None:
    """Planes [Hkv, slots, D] of one layer: plane t (written) and plane t-1 (None for plane 0);
    slots [B]; k_new/v_new [B, Hkv, D]; active [B] bool. Row b writes its new K/V at slots[b] of
    plane t when active (always on plane 0), else copies plane t-1 there."""
    b, hkv, d = k_new.shape
    has_prev = k_prev_plane is not None
    if not has_prev:
        k_prev_plane, v_prev_plane = k_plane_t, v_plane_t
    assert k_plane_t.stride() == v_plane_t.stride() == k_prev_plane.stride() == v_prev_plane.stride()
    assert k_plane_t.stride(-1) == 1
    k_new, v_new = _unit_last_stride(k_new), _unit_last_stride(v_new)
    _write_kv_kernel[(b,)](
        k_plane_t, v_plane_t, k_prev_plane, v_prev_plane, slots, k_new, v_new, active,
        k_plane_t.stride(0), k_plane_t.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        H=hkv, D=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d), HAS_PREV=has_prev,
        num_warps=4)
