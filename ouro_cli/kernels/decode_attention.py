"""Triton kernels of one decode layer-loop: write this loop's K/V, then attend over the paged plane.

`paged_decode_attention` computes what paged_attention.decode_attention computes (the
reference), without its gather copies and without one kernel per chunk and operation.
One program owns a (batch row, kv head) pair and the G = Hq/Hkv query heads of its
group. It walks the row's own context, tiles of BLOCK positions at absolute offsets
0, BLOCK, 2·BLOCK, … up to the row's length, reads K/V straight from the plane through
the row's slot ids, and folds each tile into an fp32 online softmax. The loop bound is
the row's length, so a row computes the same bits whatever its batch-mates and whatever
the width of the slot table (the batch-invariance the engine promises, docs/model.md §4).

Numerics follow the reference: Q·Kᵀ accumulates in fp32 and is scaled there (q is not
rounded after scaling, as in flash attention), P·V accumulates in fp32 with P rounded to the KV dtype (bf16 on the GPU,
as flash
attention does); fp32 K/V use full-precision (IEEE, not TF32) dots. The group's G query
heads are padded to 16 rows because tl.dot needs M >= 16; the padding rows load zeros and
are never stored. Results match the reference to rounding, not bit for bit (the
reductions run in another order).

`write_kv_and_attend` runs the decode step's KV write of a loop in the same kernel, before
the attention: rows still active write their new K/V into plane t at their slot; rows that
have exited copy their plane t-1 entry instead, which builds the last-exited layout of
docs/model.md §3 as the step runs. A block barrier (`tl.debug_barrier`, CUDA's __syncthreads: the
block's global stores before it are visible to the block's loads after it) separates the
store from the attention's reads. One kernel per layer and loop instead of two.

`blocked_decode_attention` is the same kernel for the trainer's replay and the prefill
(replay_attention.py): a program holds up to 16 / G queries of one run (one document, one
slot table) in the rows that a decode step fills with one query's G heads and padding,
walks the tiles up to its longest row and masks each row at its own length. A row folds the
tiles its decode step folds, through the same instruction in the same order; on a tile past
a row's own length the row keeps its state (a `tl.where`, not a fold of nothing), so its
bits are the decode step's while the tile's K/V loads serve the whole block. Under the
interpreter the dots are fp32 products summed by tl.sum (numpy's matmul promises no row
independence within a tile).

The cascade (`Cascade`, tables from engine/cascade.py) reads a prefix that several rows share
once for all of them: the samples of a GRPO group reference the same prompt blocks, so their
first tiles are the same slots. A prefix pass (`_prefix_kernel`) holds up to
queries_per_program(G) such rows in one program's rows, as the blocked mode does, folds
their shared tiles with one K/V load per tile, and stores each row's state (m, l, acc: fp32,
unnormalized); the decode kernel then starts each of those rows from its stored state at the
tile after the prefix instead of from (-inf, 0, 0) at tile 0. Both passes fold a tile through
one function (`_fold_tile`) and a row's bits do not depend on the other rows of its tile,
and an fp32 state stored and loaded is the same state, so a row folds the same tiles through
the same instructions in the same order: the split does not change the reduction order, and
every output keeps its bits. So the engine's agreement with the trainer's replay is unchanged
by it: in the default mode, and in exact mode on CUDA, which runs this kernel and whose replay
(`blocked_decode_attention`) needs no cascade of its own to stay at 0.0. The prefix
ends at a tile boundary below every member's length, so it never holds the position a WRITE
step writes.

An fp8 cache (model/kv_quant.py) hands the kernel its packed rows (uint8: head_dim fp8 values,
then the scale's exponent, then padding to a multiple of 16 bytes, so a row's values load as
16-byte vectors): a tile's rows are loaded as bytes and converted to the query's dtype, which
holds every e4m3 value exactly. The conversion (`_e4m3_values`) is Triton's casts through fp32,
which the compiler moves past the tile's trip through shared memory, so V's operand (transposed
for the P·V dot) is read back a byte at a time.

In the default mode each row's power-of-two scale 2^k is applied outside the dots, not to every
element: a key's score is the dot with its e4m3 values times its 2^k, and a position's softmax
weight takes its value row's 2^k before it is rounded for the P·V dot. A power of two scales a
product, a rounding and an fp32 sum exactly, so the tile computes, bit for bit, what it computes
on the dequantized values the replay attends over, as long as the scaled weights and products
stay in the normal range (under 2^-126 they round differently). Exact mode multiplies each
element by its row's 2^k as it loads the tile, so its bits are the dequantized values'
everywhere (`_packed_mode`). The write packs too: an active row's new K/V, as the layer hands
them over (the engine's decode layers do not round them first: model/layers.py `Attend`), becomes
kv_quant.pack's bytes through fp8_rows.py's integer quantization (values, exponent byte, zero
padding), and an exited row copies its plane t-1 row whole, scale and padding included. Packed
unrounded, a row whose largest value rounds onto a binade edge holds the values of its round
trip as twice the codes at 2^(k-1), where the replay, packing the rounded values, holds them at
2^k: exact mode multiplies the codes out, and the default mode's dots and weights scale by that
power of two exactly (in the normal range, as above), so both keep their bits.

All are CUDA-graph capturable: no host reads, and the grids depend only on shapes (the prefix
pass launches one program per batch row and kv head; those past the plan's exit at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ouro_cli.model import kv_quant
from ouro_cli.settings import active_settings

from . import bounds, checks_enabled, fp8_rows
from .gemv import dot_as_sum

# Positions per tile and warps per program; both set the kernel's summation order, so the
# trainer's paged replay (replay_attention.py) uses the same defaults, and one choice serves
# every batch (a row's bits must not depend on its batch-mates). bench/decode_attention.py
# sweeps them (why: docs/performance.md#decode).
BLOCK = 64
NUM_WARPS = 4
# Registers a thread may use in the decode kernel over packed fp8 rows with scales outside the
# dots (PACKED 2) on CUDA: under the cap more programs share a multiprocessor than at the
# compiler's own choice, for a few bytes of spilled state. A register cap leaves the arithmetic,
# so the bits, as they are (bench/kernel_options.py times it and compares the bits; the figures:
# docs/performance.md#decode).
FP8_MAXNREG = 128
# the packed fp8 format's constants, for the kernel's packed write (model/kv_quant.py)
_ROW_ALIGN: tl.constexpr = tl.constexpr(kv_quant.ROW_ALIGN)
_LOWEST_EXPONENT: tl.constexpr = tl.constexpr(kv_quant.LOWEST_EXPONENT)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _decode_attention_kernel(
    Q,
    K,
    V,
    SLOTS,
    LENGTHS,
    OUT,
    scale,
    K_PREV,
    V_PREV,
    K_NEW,
    V_NEW,
    NEW_SLOTS,
    ACTIVE,
    START,
    STATE,
    stride_qb,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_sb,
    stride_ob,
    stride_oh,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_stb,
    stride_sth,
    FIRST,
    COUNT,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
    WRITE: tl.constexpr,
    HAS_PREV: tl.constexpr,
    BLOCKED: tl.constexpr,
    CASCADE: tl.constexpr,
    DOT_AS_SUM: tl.constexpr,
    PACKED: tl.constexpr,
    ROW: tl.constexpr,
):
    KV_T: tl.constexpr = Q.dtype.element_ty if PACKED else K.dtype.element_ty  # K/V computed in: packed fp8 as q
    h = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    if BLOCKED:  # rows r = (query FIRST[p] + r // G, head h·G + r % G); the table row is the first query's
        b = tl.load(FIRST + tl.program_id(0)).to(tl.int64)
        query = b + g // G
        row_ok = g < tl.load(COUNT + tl.program_id(0)) * G
        head = h * G + g % G
    else:  # rows r = (query b, head h·G + r), r < G
        b = tl.program_id(0).to(tl.int64)
        query = b + g * 0
        row_ok = g < G
        head = h * G + g
    gd_ok = row_ok[:, None] & (d < D)[None, :]
    kv_head = K + h * stride_kh
    v_head = V + h * stride_kh
    if WRITE:  # this row's K/V of head h into its slot first (an exited row carries plane t-1's)
        new_slot = tl.load(NEW_SLOTS + b).to(tl.int64)
        k_at = K_NEW + b * stride_knb + h * stride_knh
        v_at = V_NEW + b * stride_vnb + h * stride_vnh
        if PACKED:
            _write_packed_rows(
                k_at,
                v_at,
                kv_head,
                v_head,
                K_PREV,
                V_PREV,
                ACTIVE,
                b,
                h,
                new_slot,
                stride_kh,
                stride_ks,
                d,
                D,
                ROW,
                HAS_PREV,
            )
        else:
            k_new = tl.load(k_at + d, mask=d < D).to(K.dtype.element_ty)
            v_new = tl.load(v_at + d, mask=d < D).to(V.dtype.element_ty)
            if HAS_PREV:
                carry = tl.load(ACTIVE + b) == 0
                prev_at = h * stride_kh + new_slot * stride_ks + d
                k_new = tl.where(carry, tl.load(K_PREV + prev_at, mask=d < D), k_new)
                v_new = tl.where(carry, tl.load(V_PREV + prev_at, mask=d < D), v_new)
            tl.store(kv_head + new_slot * stride_ks + d, k_new, mask=d < D)
            tl.store(v_head + new_slot * stride_ks + d, v_new, mask=d < D)
        tl.debug_barrier()  # the stores above, visible to every thread of the block below
    q = _load_queries(Q, query, head, d, gd_ok, stride_qb, stride_qh, KV_T)
    row_length = tl.load(LENGTHS + tl.where(row_ok, query, b)).to(tl.int32)  # [GP]; padding rows: the first's
    length = tl.max(row_length, 0)  # the block's longest run (a decode row's own length)
    if CASCADE:  # the row's first START[b] tiles were folded by the prefix pass: its state after them
        first_tile = tl.load(START + b).to(tl.int32)
        resume = row_ok & (first_tile + g * 0 > 0)  # [GP]: the interpreter takes no scalar in a mask
        m, l_sum, acc = _load_state(STATE, query, head, d, resume, stride_stb, stride_sth, D)
    else:
        first_tile = 0
        m = tl.full([GP], float("-inf"), tl.float32)
        l_sum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BLOCK_D], tl.float32)
    for start in range(first_tile * BLOCK, length, BLOCK):
        m, l_sum, acc = _fold_tile(
            start,
            m,
            l_sum,
            acc,
            q,
            kv_head,
            v_head,
            SLOTS + b * stride_sb,
            length,
            row_length,
            d,
            scale,
            stride_ks,
            D,
            BLOCK,
            IEEE,
            DOT_AS_SUM,
            PACKED,
            KV_T,
            BLOCKED,
        )
    o = acc / l_sum[:, None]
    tl.store(
        OUT + query[:, None] * stride_ob + head[:, None] * stride_oh + d[None, :],
        o.to(OUT.dtype.element_ty),
        mask=gd_ok,
    )


@triton.jit
def _write_packed_rows(
    k_at,
    v_at,
    kv_head,
    v_head,
    K_PREV,
    V_PREV,
    ACTIVE,
    b,
    h,
    new_slot,
    stride_kh,
    stride_ks,
    d,
    D: tl.constexpr,
    ROW: tl.constexpr,
    HAS_PREV: tl.constexpr,
):
    """Row b's K and V of head h as packed fp8 rows (ROW bytes, kv_quant.pack's) into slot new_slot
    of plane t (kv_head, v_head): its new K/V (k_at, v_at, in the model's dtype) quantized, or,
    where it has exited (HAS_PREV), plane t-1's row copied byte for byte."""
    t = tl.arange(0, _ROW_ALIGN)
    body_ok = (d < D)[None, :]
    tail_ok = (D + t < ROW)[None, :]
    k_codes, k_exp = fp8_rows.quantize(tl.load(k_at + d[None, :], mask=body_ok, other=0.0), _LOWEST_EXPONENT)
    v_codes, v_exp = fp8_rows.quantize(tl.load(v_at + d[None, :], mask=body_ok, other=0.0), _LOWEST_EXPONENT)
    k_body, k_tail = fp8_rows.pack_row(k_codes, k_exp, t)
    v_body, v_tail = fp8_rows.pack_row(v_codes, v_exp, t)
    at = new_slot * stride_ks
    if HAS_PREV:
        carry = tl.load(ACTIVE + b) == 0
        prev_at = h * stride_kh + at
        k_body = tl.where(carry, tl.load(K_PREV + prev_at + d[None, :], mask=body_ok, other=0), k_body)
        v_body = tl.where(carry, tl.load(V_PREV + prev_at + d[None, :], mask=body_ok, other=0), v_body)
        k_tail = tl.where(carry, tl.load(K_PREV + prev_at + D + t[None, :], mask=tail_ok, other=0), k_tail)
        v_tail = tl.where(carry, tl.load(V_PREV + prev_at + D + t[None, :], mask=tail_ok, other=0), v_tail)
    tl.store(kv_head + at + d[None, :], k_body, mask=body_ok)
    tl.store(v_head + at + d[None, :], v_body, mask=body_ok)
    tl.store(kv_head + at + D + t[None, :], k_tail, mask=tail_ok)
    tl.store(v_head + at + D + t[None, :], v_tail, mask=tail_ok)


@triton.jit
def _prefix_kernel(
    Q,
    K,
    V,
    SLOTS,
    LENGTHS,
    START,
    MEMBERS,
    FIRST,
    COUNT,
    STATE,
    scale,
    stride_qb,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_sb,
    stride_stb,
    stride_sth,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_AS_SUM: tl.constexpr,
    PACKED: tl.constexpr,
):
    """The cascade's prefix pass: program (p, h) holds rows r = (member MEMBERS[FIRST[p] + r // G],
    head h·G + r % G), folds the first START tiles of its first member (which every member shares,
    slot for slot) with one K/V load per tile for all of them, and stores each row's state. A
    program with COUNT[p] = 0 folds and stores nothing."""
    KV_T: tl.constexpr = Q.dtype.element_ty if PACKED else K.dtype.element_ty
    h = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    at = tl.load(FIRST + tl.program_id(0))
    count = tl.load(COUNT + tl.program_id(0))
    row_ok = g < count * G
    b = tl.load(MEMBERS + at).to(tl.int64)  # the first member, whose table row the program reads
    query = tl.where(row_ok, tl.load(MEMBERS + at + g // G, mask=row_ok, other=0).to(tl.int64), b)
    head = h * G + g % G
    tiles = tl.where(count > 0, tl.load(START + b), 0).to(tl.int32)
    q = _load_queries(Q, query, head, d, row_ok[:, None] & (d < D)[None, :], stride_qb, stride_qh, KV_T)
    row_length = tl.load(LENGTHS + query).to(tl.int32)
    length = tl.max(row_length, 0)
    m = tl.full([GP], float("-inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BLOCK_D], tl.float32)
    for start in range(0, tiles * BLOCK, BLOCK):  # every tile lies below every member's length
        m, l_sum, acc = _fold_tile(
            start,
            m,
            l_sum,
            acc,
            q,
            K + h * stride_kh,
            V + h * stride_kh,
            SLOTS + b * stride_sb,
            length,
            row_length,
            d,
            scale,
            stride_ks,
            D,
            BLOCK,
            IEEE,
            DOT_AS_SUM,
            PACKED,
            KV_T,
            False,
        )
    at_state = STATE + query * stride_stb + head * stride_sth
    tl.store(at_state[:, None] + d[None, :], acc, mask=row_ok[:, None] & (d < D)[None, :])
    tl.store(at_state + D, m, mask=row_ok)
    tl.store(at_state + D + 1, l_sum, mask=row_ok)


@triton.jit
def _load_state(STATE, query, head, d, resume, stride_stb, stride_sth, D: tl.constexpr):
    """The prefix pass's state (m, l, acc) of the rows with `resume`, as `_prefix_kernel` stored it
    (STATE[query, head]: acc [D], m, l in fp32); the empty state (-inf, 0, 0) of the others."""
    at = STATE + query * stride_stb + head * stride_sth
    acc = tl.load(at[:, None] + d[None, :], mask=resume[:, None] & (d < D)[None, :], other=0.0)
    m = tl.load(at + D, mask=resume, other=float("-inf"))
    l_sum = tl.load(at + D + 1, mask=resume, other=0.0)
    return m, l_sum, acc


@triton.jit
def _load_queries(Q, query, head, d, gd_ok, stride_qb, stride_qh, KV_T: tl.constexpr):
    """The rows' queries [GP, BLOCK_D] in the dtype K/V are computed in (padding rows: zeros)."""
    q = tl.load(Q + query[:, None] * stride_qb + head[:, None] * stride_qh + d[None, :], mask=gd_ok, other=0.0)
    return q.to(KV_T)


@triton.jit
def _fold_tile(
    start,
    m,
    l_sum,
    acc,
    q,
    kv_head,
    v_head,
    slot_row,
    length,
    row_length,
    d,
    scale,
    stride_ks,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_AS_SUM: tl.constexpr,
    PACKED: tl.constexpr,
    KV_T: tl.constexpr,
    BLOCKED: tl.constexpr,
):
    """Fold the tile of positions start .. start + BLOCK - 1 (slot ids at slot_row) into each row's
    online softmax (m, l_sum, acc) -> the new state. The one copy of the tile's math: the decode
    kernel and the prefix pass both fold through it, so a tile gives a row the same bits in either."""
    n = start + tl.arange(0, BLOCK)
    n_ok = n < length
    slot = tl.load(slot_row + n, mask=n_ok, other=0).to(tl.int64)
    nd_ok = n_ok[:, None] & (d < D)[None, :]
    if PACKED == 2:  # the dot over the e4m3 values, times each key's 2^k: the dot over the stored values
        k, k_scale = _load_codes(kv_head, slot, d, nd_ok, n_ok, stride_ks, D, KV_T)
        s = _dot(q, tl.trans(k), IEEE, DOT_AS_SUM) * k_scale[None, :]
    else:
        k = _load_rows(kv_head, slot, d, nd_ok, n_ok, stride_ks, D, PACKED, KV_T)
        s = _dot(q, tl.trans(k), IEEE, DOT_AS_SUM)
    # [GP, BLOCK]; every tile holds >= 1 position of a decode row, and of a block's longest row
    s = tl.where(n[None, :] < row_length[:, None], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)  # exp(-inf) = 0 on the first tile
    p = tl.exp(s - m_new[:, None])
    l_new = l_sum * alpha + tl.sum(p, 1)
    if PACKED == 2:  # each position's weight takes its value row's 2^k, so the dot reads the e4m3 values
        v, v_scale = _load_codes(v_head, slot, d, nd_ok, n_ok, stride_ks, D, KV_T)
        p_v = (p * v_scale[None, :]).to(KV_T)
    else:
        v = _load_rows(v_head, slot, d, nd_ok, n_ok, stride_ks, D, PACKED, KV_T)
        p_v = p.to(KV_T)
    acc_new = acc * alpha[:, None] + _dot(p_v, v, IEEE, DOT_AS_SUM)
    if BLOCKED:  # a row whose run ended before this tile keeps its state: the tiles a decode row never reads
        live = start < row_length
        m_new = tl.where(live, m_new, m)
        l_new = tl.where(live, l_new, l_sum)
        acc_new = tl.where(live[:, None], acc_new, acc)
    return m_new, l_new, acc_new


@triton.jit
def _load_rows(
    head,
    slot,
    d,
    nd_ok,
    n_ok,
    stride_ks,
    D: tl.constexpr,
    PACKED: tl.constexpr,
    KV_T: tl.constexpr,
):
    """The K (or V) rows [BLOCK, BLOCK_D] of one head at `slot` in KV_T: as stored (PACKED 0), or
    packed fp8 rows (model/kv_quant.py) as values · 2^k (PACKED 1; exact in KV_T)."""
    if PACKED:
        codes, scale = _load_codes(head, slot, d, nd_ok, n_ok, stride_ks, D, tl.float32)
        return (codes * scale[:, None]).to(KV_T)
    else:
        return tl.load(head + slot[:, None] * stride_ks + d[None, :], mask=nd_ok, other=0.0)


@triton.jit
def _load_codes(head, slot, d, nd_ok, n_ok, stride_ks, D: tl.constexpr, KV_T: tl.constexpr):
    """Packed fp8 rows [BLOCK, BLOCK_D] of one head at `slot` as their e4m3 values in KV_T (exact),
    and each row's power-of-two scale 2^k [BLOCK] in fp32."""
    raw = tl.load(head + slot[:, None] * stride_ks + d[None, :], mask=nd_ok, other=0)
    k = tl.load(head + slot * stride_ks + D, mask=n_ok, other=0).to(tl.int8, bitcast=True).to(tl.int32)
    return _e4m3_values(raw, KV_T), ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_values(raw, OUT_T: tl.constexpr):
    """The e4m3 values of the codes `raw` (uint8) in OUT_T, exactly, by Triton's casts through fp32
    (both exact: every e4m3 value has 4 significant bits and lies within bf16's and fp16's normal
    range). Through fp32 because Triton's direct cast to bf16 goes through fp16 and converts each
    element from fp16 to bf16 alone (`F2F`), where the fp32 route converts two at once."""
    return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(OUT_T)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, DOT_AS_SUM: tl.constexpr):
    """a @ b in fp32: the tensor-core dot (IEEE fp32 for fp32 operands), or under the interpreter
    (DOT_AS_SUM) gemv.dot_as_sum, whose rows do not depend on each other."""
    if DOT_AS_SUM:
        return dot_as_sum(a, b)
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@dataclass(frozen=True)
class Cascade:
    """The shared-prefix (cascade) pass of a decode batch of B rows, built by the engine
    (engine/cascade.py) from the rows' block tables:

    - `tiles` [B]: row b's first tiles[b] tiles (positions 0 .. tiles[b]·tile - 1, all below its
      length) are folded by the prefix pass; 0: the decode kernel folds all of the row's tiles;
    - `members` [B]: the rows the prefix programs hold, program after program; `first`, `count`
      [P]: program p holds members[first[p] : first[p] + count[p]], at most queries_per_program(G)
      rows that share their slots over those tiles and the same tiles (count 0: the program exits);
    - `state` [B, Hq, D + 2] fp32: scratch the prefix pass writes for each member row and head
      (acc, then m, then l) and the decode kernel reads.

    The shapes depend on B only, so a captured step launches the same grids whatever the groups."""

    tiles: torch.Tensor
    members: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor
    state: torch.Tensor
    tile: int = BLOCK

    @staticmethod
    def from_plan(plan: torch.Tensor, hq: int, d: int, tile: int = BLOCK) -> Cascade:
        """The tables of engine/cascade.py's plan [4, B] (rows tiles, members, first, count; made
        contiguous) for tiles of `tile` positions, on the plan's device, with a fresh scratch for
        Hq heads of D."""
        plan = plan.contiguous()
        state = torch.empty(plan.shape[1], hq, d + 2, dtype=torch.float32, device=plan.device)
        return Cascade(*plan, state=state, tile=tile)


def _packed_mode(packed: bool) -> int:
    """The kernels' PACKED: 0 rows as stored; over packed fp8 rows 2 (scales outside the dots), or
    1 (rows dequantized as loaded) in exact mode, whose replay attends over the dequantized values
    and so needs their bits even where a scaled weight or product underflows."""
    if not packed:
        return 0
    return 1 if active_settings().exact else 2


def launch_options(packed_mode: int, cuda: bool) -> dict[str, int]:
    """The decode kernel's Triton launch options beyond its shape (each keeps its bits), for its
    PACKED mode on CUDA or elsewhere."""
    return {"maxnreg": FP8_MAXNREG} if packed_mode == 2 and cuda else {}


def _attend(
    q, k_plane, v_plane, ctx_slots, lengths, block, num_warps, write=None, blocks=None, cascade=None
) -> torch.Tensor:
    b, hq, d = q.shape
    hkv = k_plane.shape[0]
    packed = k_plane.dtype == torch.uint8  # fp8 rows of model/kv_quant.py: row_bytes(d) bytes
    assert k_plane.shape[-1] == (kv_quant.row_bytes(d, 1, True) if packed else d)
    assert hq % hkv == 0 and k_plane.shape == v_plane.shape and k_plane.stride() == v_plane.stride()
    assert k_plane.stride(-1) == 1 and block >= 16
    q, ctx_slots = _unit_last_stride(q), _unit_last_stride(ctx_slots)
    # the kernel reads its 1-D tables as dense arrays: a broadcast view (stride 0) would be
    # read past its storage
    lengths = lengths.contiguous()
    blocks = None if blocks is None else tuple(t.contiguous() for t in blocks)
    if write is None:  # unused pointers: any tensor of the right dtype
        k_prev, v_prev, k_new, v_new, new_slots, active, has_prev = k_plane, v_plane, q, q, lengths, lengths, False
    else:
        k_prev, v_prev, new_slots, k_new, v_new, active = write
        new_slots, active = new_slots.contiguous(), active.contiguous()
        has_prev = k_prev is not None
        if not has_prev:
            k_prev, v_prev = k_plane, v_plane
        assert k_prev.stride() == k_plane.stride() and v_prev.stride() == k_plane.stride()
        k_new, v_new = _unit_last_stride(k_new), _unit_last_stride(v_new)
    g = hq // hkv
    if checks_enabled() and not bounds.capturing(q.device):
        bounds.check_attention(
            "decode attention",
            q,
            k_plane.shape[1],
            ctx_slots,
            lengths,
            blocks,
            queries_per_program(g),
            None if write is None else new_slots,
            None if write is None else k_new.shape[0],
        )
        if cascade is not None:
            bounds.check_cascade("decode attention", ctx_slots, lengths, cascade, queries_per_program(g))
    shape = {
        "G": g,
        "GP": group_rows(g),
        "D": d,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "BLOCK": block,
        "IEEE": (q.dtype if packed else k_plane.dtype) == torch.float32,
        "DOT_AS_SUM": q.device.type != "cuda",
        "PACKED": _packed_mode(packed),
        "num_warps": num_warps,
    }
    strides = (q.stride(0), q.stride(1), k_plane.stride(0), k_plane.stride(1), ctx_slots.stride(0))
    if cascade is None:
        start, state = lengths, q  # unused pointers
    else:
        assert blocks is None and cascade.tile == block and cascade.state.shape == (b, hq, d + 2)
        assert all(t.dim() == 1 and t.stride(0) == 1 for t in (cascade.tiles, cascade.members, cascade.first))
        assert cascade.count.stride(0) == 1 and cascade.state.is_contiguous()
        start, state = cascade.tiles, cascade.state
        _prefix_kernel[(cascade.first.shape[0], hkv)](
            q,
            k_plane,
            v_plane,
            ctx_slots,
            lengths,
            start,
            cascade.members,
            cascade.first,
            cascade.count,
            state,
            d**-0.5,
            *strides,
            state.stride(0),
            state.stride(1),
            **shape,
        )
    first, count = (lengths, lengths) if blocks is None else blocks
    o = torch.empty_like(q)
    _decode_attention_kernel[(b if blocks is None else first.shape[0], hkv)](
        q,
        k_plane,
        v_plane,
        ctx_slots,
        lengths,
        o,
        d**-0.5,
        k_prev,
        v_prev,
        k_new,
        v_new,
        new_slots,
        active,
        start,
        state,
        *strides,
        o.stride(0),
        o.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        state.stride(0),
        state.stride(1),
        first,
        count,
        WRITE=write is not None,
        HAS_PREV=has_prev,
        BLOCKED=blocks is not None,
        CASCADE=cascade is not None,
        ROW=k_plane.shape[-1],
        **shape,
        **launch_options(shape["PACKED"], q.device.type == "cuda"),
    )
    return o


def group_rows(g: int) -> int:
    """The rows of a program's tiles for G query heads per kv head: G padded to a power of two,
    at least 16 (tl.dot needs M >= 16)."""
    return max(16, triton.next_power_of_2(g))


def paged_decode_attention(
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    ctx_slots: torch.Tensor,
    lengths: torch.Tensor,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
    cascade: Cascade | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one new token per row); k_plane/v_plane [Hkv, slots, D] (one plane of one
    layer; or [Hkv, slots, kv_quant.row_bytes(D)] packed fp8 rows, uint8); ctx_slots [B, W] slot ids of positions
    0..W-1; lengths [B] (1 <= length <= W: a row attends to its first `length` positions) -> o
    [B, Hq, D] in q's dtype. Scale head_dim**-0.5. With `cascade` the rows' shared prefixes are
    read once per group (`Cascade`); the output has the same bits."""
    return _attend(q, k_plane, v_plane, ctx_slots, lengths, block, num_warps, cascade=cascade)


def blocked_decode_attention(
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    ctx_slots: torch.Tensor,
    lengths: torch.Tensor,
    first: torch.Tensor,
    count: torch.Tensor,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """`paged_decode_attention` of the B queries of q [B, Hq, D], several queries per program: program
    p runs queries first[p] .. first[p] + count[p] - 1 (count[p] <= queries_per_program(G)),
    which must share their context's slots up to their longest length, and reads them from
    ctx_slots[first[p]]. The queries share each tile's K/V loads; each computes the bits it
    computes alone (a row whose length ends before a tile leaves its state as it is)."""
    return _attend(q, k_plane, v_plane, ctx_slots, lengths, block, num_warps, blocks=(first, count))


def queries_per_program(g: int) -> int:
    """How many queries of G heads each fill one program's rows in `blocked_decode_attention`."""
    return max(1, group_rows(g) // g)


def write_kv_and_attend(
    q: torch.Tensor,
    k_plane_t: torch.Tensor,
    v_plane_t: torch.Tensor,
    k_prev_plane: torch.Tensor | None,
    v_prev_plane: torch.Tensor | None,
    new_slots: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    active: torch.Tensor,
    ctx_slots: torch.Tensor,
    lengths: torch.Tensor,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
    cascade: Cascade | None = None,
) -> torch.Tensor:
    """runner.py's KV write of a loop and the attention over plane t, in one kernel: row b
    writes its new K/V [B, Hkv, D] at new_slots[b] of plane t when active (always on plane 0),
    else copies plane t-1's entry there (k_prev_plane None for plane 0); then attends as
    `paged_decode_attention` (the new slot is among the row's first `length` positions; with
    `cascade`, past the row's prefix tiles). Over packed fp8 planes (uint8) the new K/V are
    written as kv_quant.pack writes them and an exited row's packed row is copied byte for byte.
    The planes and the output have the bits of the two steps run apart."""
    return _attend(
        q,
        k_plane_t,
        v_plane_t,
        ctx_slots,
        lengths,
        block,
        num_warps,
        write=(k_prev_plane, v_prev_plane, new_slots, k_new, v_new, active),
        cascade=cascade,
    )
