"""A linear layer with one summation order for every number of rows: exact mode's projections on CUDA.

`fixed_tile_linear(x, w)` computes x @ W.T on a grid of (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
programs whose tiles are constants: they depend neither on M nor on the weight. Each output
element is one fp32 accumulator that walks K in ascending BLOCK_K steps through the same
dot instruction (`tl.dot(x, wᵀ, acc)`); there is no split-K and no atomic, and rows past M
load zeros. So a row's bits are a function of that row and W alone: the decode step's 8
rows, a prefill's hundreds and the trainer's thousands go through the same compiled kernel
and the same instruction sequence per element (model/exact.py, docs/exact.md). cuBLAS
promises nothing of the kind: its heuristics pick another kernel, or a split-K one, as M
changes.

What fixes an element's bits is the walk over K: BLOCK_K (64 for 16-bit, 32 with IEEE fp32
dots), ascending, one fp32 accumulator, the same dot instruction family. The M x N tile only
says which program computes the element. So the tile shape may follow the row count and
the weight's width (`CONFIGS`: small tiles keep enough programs reading W at a decode
step's few hundred rows, large ones feed the tensor cores at a prefill's or the trainer's
thousands; why: docs/performance.md#exact-mode), but only among configs whose outputs
are equal bit for bit: a GPU test (tests/gpu/test_exact_gpu.py) runs
each shape's rows alone, few and many, across the thresholds, and `python bench/fixed_tile.py
--sweep` checks every candidate's bits against the base config before it may join `CONFIGS`.
fp32 keeps the base config at every M (only the 16-bit configs are checked on a GPU).
Programs walk the tiles in groups of GROUP_M row blocks, so a group reuses the same W columns
from L2 (the order of programs changes no bits).

Off CUDA it runs under the Triton interpreter only (the CPU tests), with the dot as an
fp32 product summed by tl.sum (gemv.py's `accumulate`, DOT_AS_SUM: the interpreter's
tl.dot is numpy's matmul, whose BLAS may sum a row by its place in the tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import accumulate

# (BLOCK_M, BLOCK_N, warps, stages): the config every other one must equal bit for bit, the
# only one for fp32 and off CUDA
BASE = (64, 64, 4, 3)
# (up to this many rows, up to this many output columns, config): the first entry that holds
# a call's M and N, chosen by `bench/fixed_tile.py --sweep` (why: docs/performance.md#exact-mode).
CONFIGS = (
    (64, None, (64, 64, 4, 4)),
    (128, 16384, (64, 64, 4, 4)),
    (128, None, (128, 64, 8, 3)),
    (256, 2048, BASE),
    (256, 6144, (128, 128, 8, 3)),
    (256, 16384, (64, 128, 4, 3)),
    (256, None, (128, 128, 8, 3)),
    (512, 2048, (128, 64, 8, 3)),
    (512, 6144, (64, 128, 4, 3)),
    (1024, None, (128, 128, 8, 3)),
    (None, None, (256, 128, 8, 3)),
)
GROUP_M = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _fixed_tile_kernel(
    X,
    W,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_AS_SUM: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # program -> tile in groups of GROUP_M row blocks, column by column within a group
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = (rm < M)[:, None]
    n_ok = (rn < N)[:, None]
    x_rows = X + rm[:, None] * stride_xm
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x_ok, w_ok = m_ok, n_ok
        if not EVEN_K:
            k_ok = (k < K)[None, :]
            x_ok, w_ok = x_ok & k_ok, w_ok & k_ok
        x = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)
        wt = tl.trans(tl.load(w_rows + k[None, :], mask=w_ok, other=0.0))
        acc = accumulate(acc, x, wt, IEEE, DOT_AS_SUM)
    y = Y + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_ok & (rn < N)[None, :])


def block_k(dtype: torch.dtype) -> int:
    return 32 if dtype == torch.float32 else 64


def fixed_tile_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] (nn.Linear layout), one dtype of bf16, fp16, fp32 -> x @ w.T [M, N] in
    that dtype, accumulated in fp32; row m's bits depend only on x[m] and w."""
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"fixed_tile_linear takes x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x and w must share a dtype of bf16, fp16, fp32; got {x.dtype} and {w.dtype}")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    return launch(x, w, config_for(x.shape[0], w.shape[0], x.dtype, x.device.type))


def config_for(m: int, n: int, dtype: torch.dtype, device_type: str) -> tuple[int, int, int, int]:
    """The tile config (BLOCK_M, BLOCK_N, warps, stages) for m rows and n output columns: BASE for
    fp32 and off CUDA, else the first entry of CONFIGS whose limits hold m and n. All give the
    same bits."""
    if dtype == torch.float32 or device_type != "cuda":
        return BASE
    return next(
        config for rows, columns, config in CONFIGS if (rows is None or m <= rows) and (columns is None or n <= columns)
    )


def launch(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int]) -> torch.Tensor:
    """x [M, K] @ w.T with the given tile config (fixed_tile_linear's checks already made)."""
    block_m, block_n, warps, stages = config
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bk = block_k(x.dtype)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fixed_tile_kernel[grid](
        x,
        w,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk,
        EVEN_K=k % bk == 0,
        IEEE=x.dtype == torch.float32,
        DOT_AS_SUM=x.device.type != "cuda",
        GROUP_M=GROUP_M,
        num_warps=warps,
        num_stages=stages,
    )
    return y
