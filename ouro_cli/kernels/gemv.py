"""A small-M linear layer, y = x @ W.T, for the decode step's projections (opt-in; bitwise = cuBLAS at many rows).

A decode step multiplies a padded batch of M = 8..64 activation rows by every weight of
the model; at such M the work is reading W once. Here a program owns BLOCK_N output columns
and all M rows: the grid is cdiv(N, BLOCK_N) (>= 2 programs per SM where N allows), each
program streams its BLOCK_N rows of W through a num_stages-deep pipeline of BLOCK_K tiles,
and x (small, L2-resident) is re-read by every program.

Its value is numerical: no split-K at any M, where cuBLAS at a few rows may split K
(down_proj); speed against cuBLAS: docs/performance.md#decode. The engine uses it where
`--decode-gemv` says (ouro_cli/settings.py).

Determinism and batch invariance (the engine needs graph replay == eager bit for bit, and
a row's bits independent of its batch-mates, docs/model.md §4): there is no split-K and no atomic;
every output element is one fp32 accumulator that walks K in ascending order, 16 at a time
through the tensor cores (the dot accumulates in place, `tl.dot(x, wᵀ, acc)`), whatever the
tiles. What could still change a row's bits with M is the instruction: on Hopper, Triton
lowers a dot of 64 rows to wgmma and one of 16 or 32 rows to mma.sync (seen in the sm_90
PTX of Triton 3.9), which need not round alike. So a dot never holds more than 32 rows:
M <= 16 uses one 16-row tile, M <= 32 one 32-row tile, 33..64 two 32-row tiles sharing
each W tile, and every M runs mma.sync m16n8k16. The default tiles are a function of (N, K, dtype), never of M. fp32
inputs use
IEEE dots (no TF32).

The engine uses this only on CUDA; the CPU tests run it under the Triton interpreter
(TRITON_INTERPRET=1). There each tile's dot is the fp32 products summed over K by tl.sum
(DOT_AS_SUM, set off CUDA only, a constexpr: the sm_90 PTX is the same as without it),
since the interpreter's tl.dot, numpy's matmul, is not batch invariant itself (see
small_m_linear); so the CPU tests check the kernel's own invariance (tiles, masks, row
tiles), not the BLAS's. Importing this module needs triton; nothing else in the package
imports it at import time (see kernels/__init__.py). CUDA-graph capturable: no host reads,
and the grid depends only on shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 64
H200_SMS = 132
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def dot_as_sum(x, w):
    """x @ w in fp32 as the interpreter runs it for the kernels' bit checks: the fp32 products
    reduced over K by tl.sum, which numpy takes output by output over that output's own
    products, so that a row's sum does not depend on the other rows of its tile (numpy's matmul,
    the interpreter's tl.dot, promises no such thing; small_m_linear says why not tl.dot)."""
    return tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def accumulate(acc, x, w, IEEE: tl.constexpr, DOT_AS_SUM: tl.constexpr):
    """acc + x @ w for x [ROWS, BLOCK_K], w [BLOCK_K, BLOCK_N], in fp32: the tensor-core dot
    accumulating into acc, or (DOT_AS_SUM, the interpreter) `dot_as_sum` added to it."""
    if DOT_AS_SUM:
        acc += dot_as_sum(x, w)
    elif IEEE:
        acc = tl.dot(x, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def _small_m_linear_kernel(
    X,
    W,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    ROWS: tl.constexpr,
    ROW_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_AS_SUM: tl.constexpr,
):
    pid = tl.program_id(0)
    rm = tl.arange(0, ROWS)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m0_ok = rm < M
    m1_ok = rm + ROWS < M
    n_ok = rn < N
    x0 = X + rm[:, None] * stride_xm
    x1 = X + (rm + ROWS)[:, None] * stride_xm
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    acc0 = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        w_ok, x0_ok, x1_ok = n_ok[:, None], m0_ok[:, None], m1_ok[:, None]
        if not EVEN_K:  # the K tail; the 1.4B shapes have none, and their loads carry only the row masks
            k_ok = (k < K)[None, :]
            w_ok, x0_ok, x1_ok = w_ok & k_ok, x0_ok & k_ok, x1_ok & k_ok
        wt = tl.trans(tl.load(w_rows + k[None, :], mask=w_ok, other=0.0))
        acc0 = accumulate(acc0, tl.load(x0 + k[None, :], mask=x0_ok, other=0.0), wt, IEEE, DOT_AS_SUM)
        if ROW_TILES == 2:
            acc1 = accumulate(acc1, tl.load(x1 + k[None, :], mask=x1_ok, other=0.0), wt, IEEE, DOT_AS_SUM)
    y = Y + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc0.to(Y.dtype.element_ty), mask=m0_ok[:, None] & n_ok[None, :])
    if ROW_TILES == 2:
        tl.store(y + ROWS * stride_ym, acc1.to(Y.dtype.element_ty), mask=m1_ok[:, None] & n_ok[None, :])


def default_config(n: int, k: int, dtype: torch.dtype) -> dict[str, int]:
    """Tiles for W [n, k], never a function of M (the same tiles, so the same bits, at every
    batch size), as bench/gemv.py's sweeps chose them per weight:
    - n <= 4096 (o_proj, down at 1.4B): BLOCK_N 16, BLOCK_K of 1 KB of a row (512 bf16);
    - 4096 < n <= 8192 (qkv): BLOCK_N 64, BLOCK_K 512 bytes.
    Wider weights (gate_up, lm_head: not swept) keep the first rule's BLOCK_N: the widest of
    64, 32, 16 that gives >= 2 programs per SM, with BLOCK_K of 512 bytes. 4 warps; 4 stages,
    fewer where x's and W's buffered tiles would not fit in shared memory (`stages_that_fit`;
    the stages only pipeline the loads, they do not change the sums)."""
    if n <= 4096:
        block_n, row_bytes = 16, 1024
    elif n <= 8192:
        block_n, row_bytes = 64, 512
    else:
        block_n, row_bytes = next((b for b in (64, 32, 16) if triton.cdiv(n, b) >= 2 * H200_SMS), 16), 512
    block_k = min(row_bytes // dtype.itemsize, max(16, triton.next_power_of_2(k)))
    return {"block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 4}


SHARED_MEMORY = 200 * 1024  # of the 227 KB a CTA may have on sm_90, with room for the compiler's own


def stages_that_fit(rows: int, row_tiles: int, block_n: int, block_k: int, itemsize: int, stages: int) -> int:
    """The most pipeline stages (<= `stages`, >= 2) whose buffered tiles fit: Triton keeps
    stages - 1 tiles of x (rows·row_tiles × BLOCK_K) and of W (BLOCK_N × BLOCK_K)."""
    per_stage = (rows * row_tiles + block_n) * block_k * itemsize
    while stages > 2 and (stages - 1) * per_stage > SHARED_MEMORY:
        stages -= 1
    return stages


def small_m_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x [M, K] (1 <= M <= 64), w [N, K] (nn.Linear layout, unit stride along K), one dtype of
    bf16, fp16, fp32 -> x @ w.T [M, N] in that dtype, accumulated in fp32. Row m's bits depend
    only on x[m], w and the tiles; the keyword overrides (None: default_config) are for
    benchmark sweeps. Raises ValueError on shapes or dtypes it does not take."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"small_m_linear takes x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x has K = {k} but w [N, K] has K = {w.shape[1]}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"small_m_linear takes 1..{MAX_M} rows, got M = {m}; use torch.nn.functional.linear")
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x and w must share a dtype of bf16, fp16, fp32; got {x.dtype} and {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but w on {w.device}")
    if w.stride(1) != 1:
        raise ValueError("w must have unit stride along K (a copy would cost more than the product)")
    x = x if x.stride(1) == 1 else x.contiguous()
    config = default_config(n, k, x.dtype)
    block_n = block_n or config["block_n"]
    block_k = block_k or config["block_k"]
    rows = max(16, min(32, triton.next_power_of_2(m)))  # see the module docstring: <= 32 rows per dot
    row_tiles = triton.cdiv(m, rows)
    stages = num_stages or stages_that_fit(rows, row_tiles, block_n, block_k, x.dtype.itemsize, config["num_stages"])
    # off CUDA only the Triton interpreter runs this, where tl.dot is numpy's matmul of the
    # whole tile: its BLAS may sum an output in an order set by the output's place in the tile
    # (OpenBLAS's Haswell sgemm, numpy's choice on AMD Zen, sums rows 6..11 of a 16-row tile
    # in another order than the rest), i.e. by the row's index in the batch, and it multiplies
    # bf16 as the raw uint16 the interpreter stores. So there the dot is DOT_AS_SUM.
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _small_m_linear_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        ROWS=rows,
        ROW_TILES=row_tiles,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        IEEE=x.dtype == torch.float32,
        DOT_AS_SUM=x.device.type != "cuda",
        num_warps=num_warps or config["num_warps"],
        num_stages=stages,
    )
    return y


AUTO_MAX_ROWS = 16
AUTO_MAX_N = 8192


def small_m_linear_where_faster(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`--decode-gemv auto`: this kernel where bench/gemv.py finds it faster than cuBLAS
    (M <= 16 rows, W up to 8192 outputs: qkv, o_proj, down at 1.4B), F.linear elsewhere.
    Which one runs depends on the shapes only (why: docs/performance.md#decode)."""
    if x.shape[0] <= AUTO_MAX_ROWS and w.shape[0] <= AUTO_MAX_N:
        return small_m_linear(x, w)
    return torch.nn.functional.linear(x, w)
