"""A linear layer with one summation order for every number of rows: exact mode's projections on CUDA.

`fixed_tile_linear(x, w)` computes x @ W.T on a grid of (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
programs whose tiles are constants: they depend neither on M nor on the weight. Each output
element is one fp32 accumulator that walks K in ascending BLOCK_K steps through the same
dot instruction (`tl.dot(x, wᵀ, acc)`); there is no split-K and no atomic, and rows past M
load zeros. So a row's bits are a function of that row and W alone: the decode step's 8
rows, a prefill's hundreds and the trainer's thousands go through the same compiled kernel
and the same instruction sequence per element (model/exact.py, docs/exact.md). cuBLAS
promises nothing of the kind: its heuristics pick another kernel, or a split-K one, as M
changes (docs/performance.md: down_proj at 8 rows vs 8,192).

The tiles (64 x 64 x 64 for 16-bit, BLOCK_K 32 with IEEE fp32 dots) are a compromise: 64
rows fill a tensor-core tile for the trainer, and 64 columns keep enough programs reading
W for the decode step's few rows. They are not tuned (bench/exact.py measures the cost on
an H200); whatever they become, they must stay independent of M.

Off CUDA it runs under the Triton interpreter only (the CPU tests), with the dot as an
fp32 product summed by tl.sum (gemv.py's `_accumulate`, DOT_AS_SUM: the interpreter's
tl.dot is numpy's matmul, whose BLAS may sum a row by its place in the tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import _accumulate

BLOCK_M, BLOCK_N = 64, 64
NUM_WARPS, NUM_STAGES = 4, 3
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _fixed_tile_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       IEEE: tl.constexpr, DOT_AS_SUM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
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
        acc = _accumulate(acc, x, wt, IEEE, DOT_AS_SUM)
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
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bk = block_k(x.dtype)
    _fixed_tile_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=bk, EVEN_K=k % bk == 0, IEEE=x.dtype == torch.float32,
        DOT_AS_SUM=x.device.type != "cuda", num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y
