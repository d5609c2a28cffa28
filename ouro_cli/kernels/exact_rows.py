"""Exact mode's row functions on CUDA as one Triton kernel each: RMSNorm (alone, closing a
residual add, and followed by the next norm), SwiGLU's silu(gate)·up, log-softmax, and RoPE.

Exact mode (model/exact.py, docs/exact.md) needs every value a token gets to be a function of
that token's own inputs. Its torch code spells each function out as a chain of elementwise
ops and pairwise-tree sums, one kernel per op (why: docs/performance.md#exact-mode). Here
each function is one launch. A row is one program (silu·up, elementwise, any split), and a
program's summation order is fixed by the row's length alone: the block is the next power of two of the
hidden size (log-softmax walks the vocabulary in fixed chunks of VOCAB_CHUNK, accumulating per
lane and summing the lanes once), and the warps by the block. So a row's bits are the same
whether it is one of the decode step's 8 rows or of the trainer's thousands, as the torch
chains' are; the engine and the trainer run these very kernels, so they agree to the bit.
The bits differ from the torch chains' (another order): a run uses one or the other on both
sides (`settings.exact_kernels`).

Roundings are those of docs/model.md §2: the norm in fp32, rounded to the activation dtype
before the weight multiplies it; silu in fp32, rounded, then times `up`; a residual add is
one rounding; RoPE rounds each product and their sum, as torch's eager ops do (the checks
compare it with the eager formula bit for bit; in bf16 under the interpreter, whose casts
truncate, with that formula written out with truncating casts). Backward passes are the
pullbacks (torch.func.vjp) of the plain formulas (model/formulas.py) at the saved inputs,
compiled where the forward's settings compile: the gradients of the same functions, which
exact mode allows (docs/exact.md §2). Off CUDA the kernels run under the Triton interpreter
(the CPU tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ouro_cli.model import compiling, formulas
from ouro_cli.settings import active_settings

VOCAB_CHUNK = 4096  # log-softmax's lanes: the vocabulary is walked in chunks of this many entries
ELEMENTWISE_BLOCK = 1024


@triton.jit
def _normed(x, w_ptr, cols, ok, n_cols, eps):
    """w * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)), the normed row rounded to the weight's dtype
    (the activations', `_supported`) before the product; the product in fp32 (one row)."""
    wide = x.to(tl.float32)
    mean_square = tl.sum(wide * wide, axis=0) / n_cols
    normed = (wide * tl.math.rsqrt(mean_square + eps)).to(w_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    return w.to(tl.float32) * normed.to(tl.float32)


@triton.jit
def _rms_rows_kernel(
    X,
    H,
    W,
    W2,
    OUT,
    OUT2,
    n_cols,
    eps,
    stride_x,
    stride_h,
    stride_o,
    stride_o2,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
    THEN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    dtype = OUT.dtype.element_ty
    y = _normed(x, W, cols, ok, n_cols, eps).to(dtype)
    if ADD:
        h = tl.load(H + row * stride_h + cols, mask=ok, other=0.0)
        y = (h.to(tl.float32) + y.to(tl.float32)).to(dtype)
    tl.store(OUT + row * stride_o + cols, y, mask=ok)
    if THEN:
        y2 = _normed(y, W2, cols, ok, n_cols, eps).to(dtype)
        tl.store(OUT2 + row * stride_o2 + cols, y2, mask=ok)


@triton.jit
def _silu_mul_kernel(G, U, OUT, n, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = at < n
    g = tl.load(G + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + at, mask=ok, other=0.0)
    dtype = OUT.dtype.element_ty
    silu = (g * (1.0 / (1.0 + tl.exp(-g)))).to(dtype)
    tl.store(OUT + at, (silu.to(tl.float32) * u.to(tl.float32)).to(dtype), mask=ok)


@triton.jit
def _rotary_kernel(
    X,
    COS,
    SIN,
    OUT,
    heads,
    stride_xr,
    stride_xh,
    stride_cr,
    stride_sr,
    stride_or,
    stride_oh,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # one position's heads [BLOCK_H, 2·HALF]: out = x·cos + rotate_half(x)·sin, each product and
    # the sum rounded to the output dtype as torch's eager ops round them (no fused multiply-add:
    # the launch turns fp fusion off)
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF)[None, :]
    ok = h < heads
    x = X + row * stride_xr + h * stride_xh
    lo = tl.load(x + j, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(x + HALF + j, mask=ok, other=0.0).to(tl.float32)
    c = COS + row * stride_cr
    s = SIN + row * stride_sr
    dtype = OUT.dtype.element_ty
    out = OUT + row * stride_or + h * stride_oh
    first = (lo * tl.load(c + j).to(tl.float32)).to(dtype).to(tl.float32) + (-hi * tl.load(s + j).to(tl.float32)).to(
        dtype
    ).to(tl.float32)
    second = (hi * tl.load(c + HALF + j).to(tl.float32)).to(dtype).to(tl.float32) + (
        lo * tl.load(s + HALF + j).to(tl.float32)
    ).to(dtype).to(tl.float32)
    tl.store(out + j, first.to(dtype), mask=ok)
    tl.store(out + HALF + j, second.to(dtype), mask=ok)


@triton.jit
def _log_softmax_kernel(X, OUT, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    x_row, o_row = X + row * stride_x, OUT + row * stride_o
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        at = start + lanes
        top = tl.maximum(top, tl.load(x_row + at, mask=at < n_cols, other=float("-inf")).to(tl.float32))
    m = tl.max(top, axis=0)
    m = tl.where(tl.abs(m) < float("inf"), m, 0.0)  # a non-finite max (NaN too) shifts by 0
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        at = start + lanes
        x = tl.load(x_row + at, mask=at < n_cols, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - m)
    log_sum = tl.log(tl.sum(acc, axis=0))
    for start in range(0, n_cols, BLOCK):
        at = start + lanes
        ok = at < n_cols
        x = tl.load(x_row + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(o_row + at, ((x - m) - log_sum).to(OUT.dtype.element_ty), mask=ok)


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supported(*tensors: torch.Tensor) -> bool:
    """Whether these kernels take the arguments: one dtype of bf16, fp16, fp32 (exact mode's fp64,
    the tests' references and gradcheck, stays on the torch code)."""
    return tensors[0].dtype in DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)


def _warps(block: int) -> int:
    """Warps per row program: a function of the block (so of the row length) alone."""
    return min(16, max(1, block // 256))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])


def _rms_forward(x, weight, eps, h=None, next_weight=None):
    rows = _rows(x)
    n, width = rows.shape
    hr = _rows(h) if h is not None else rows
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = torch.empty_like(out) if next_weight is not None else out
    o, o2 = out.view(-1, width), out2.view(-1, width)
    block = triton.next_power_of_2(width)
    if n:
        _rms_rows_kernel[(n,)](
            rows,
            hr,
            weight,
            next_weight if next_weight is not None else weight,
            o,
            o2,
            width,
            eps,
            rows.stride(0),
            hr.stride(0),
            o.stride(0),
            o2.stride(0),
            BLOCK=block,
            ADD=h is not None,
            THEN=next_weight is not None,
            num_warps=_warps(block),
        )
    return out, out2


class _RowFunction(torch.autograd.Function):
    """forward: a kernel of this module (its bits); backward: the pullback of `reference`, the
    plain formula, at the saved inputs (`_pullback`). `inputs` are the tensor arguments, `extra`
    the rest (eps)."""

    @staticmethod
    def forward(ctx, kernel, reference, extra, *inputs):
        ctx.reference, ctx.extra = reference, extra
        ctx.compiled = active_settings().compiles_gradients(inputs[0].device.type)  # the forward's settings
        ctx.save_for_backward(*inputs)
        out = kernel(*inputs, *extra)
        ctx.outputs = [(o.shape, o.dtype) for o in (out if isinstance(out, tuple) else (out,))]
        return out

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        cotangents = tuple(
            g if g is not None else torch.zeros(shape, dtype=dtype, device=inputs[0].device)
            for g, (shape, dtype) in zip(grads, ctx.outputs, strict=True)
        )
        got = _pullback(ctx.reference, ctx.compiled)(inputs, ctx.extra, cotangents)
        needs = ctx.needs_input_grad[3:]
        return None, None, None, *(g if need else None for g, need in zip(got, needs, strict=True))


@functools.cache
def _pullback(reference, compiled: bool):
    """(inputs, extra, cotangents) -> the gradients of `reference(*inputs, *extra)` for every
    input: torch.func.vjp of the plain formula, compiled shape-generic where the forward's
    settings compile (CUDA by default), not op by op (why: docs/performance.md#exact-mode).
    Gradients need no fixed order (docs/exact.md §2): they are the same function's, as fused as
    the default mode's."""

    def pullback(inputs, extra, cotangents):
        outs, pull = torch.func.vjp(lambda *t: reference(*t, *extra), *inputs)
        return pull(cotangents if isinstance(outs, tuple) else cotangents[0])

    return compiling.compiled(pullback, True) if compiled else pullback


def _run(kernel, reference, extra, *inputs):
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _RowFunction.apply(kernel, reference, extra, *inputs)
    return kernel(*inputs, *extra)


def _log_softmax_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * rms_norm(x)` over the last axis, in x's dtype (model/exact.py's `rms_norm`)."""
    return _run(lambda x, w, eps: _rms_forward(x, w, eps)[0], formulas.rms_norm, (eps,), x, weight)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h + rms_norm(x, weight)`."""
    return _run(lambda h, x, w, eps: _rms_forward(x, w, eps, h=h)[0], formulas.add_rms_norm, (eps,), h, x, weight)


def add_rms_norm_then_norm(
    h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`h' = h + rms_norm(x, weight)`, `rms_norm(h', next_weight)`) in one pass."""
    return _run(
        lambda h, x, w, w2, eps: _rms_forward(x, w, eps, h=h, next_weight=w2),
        formulas.add_rms_norm_then_norm,
        (eps,),
        h,
        x,
        weight,
        next_weight,
    )


def _silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](gate, up, out, n, BLOCK=ELEMENTWISE_BLOCK)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) in fp32, rounded to gate's dtype, times `up`."""
    return _run(_silu_mul_forward, formulas.silu_mul, (), gate, up)


def _log_softmax_forward(x: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    n, width = rows.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o = out.view(-1, width)
    block = min(VOCAB_CHUNK, triton.next_power_of_2(width))
    if n:
        _log_softmax_kernel[(n,)](rows, o, width, rows.stride(0), o.stride(0), BLOCK=block, num_warps=_warps(block))
    return out


def rotary_supported(q: torch.Tensor) -> bool:
    """Whether `rotary` takes a head size of q's: half of it a power of two (Triton's ranges)."""
    half = q.shape[-1] // 2
    return q.shape[-1] % 2 == 0 and half >= 1 and half & (half - 1) == 0


def _rotate_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] (any row stride), cos / sin [..., D] -> RoPE of x, contiguous."""
    heads, d = x.shape[-2], x.shape[-1]
    rows = x.reshape(-1, heads, d) if x.stride(-1) == 1 else x.contiguous().view(-1, heads, d)
    c, s = _rows(cos), _rows(sin)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o = out.view(-1, heads, d)
    if rows.shape[0]:
        _rotary_kernel[(rows.shape[0],)](
            rows,
            c,
            s,
            o,
            heads,
            rows.stride(0),
            rows.stride(1),
            c.stride(0),
            s.stride(0),
            o.stride(0),
            o.stride(1),
            HALF=d // 2,
            BLOCK_H=triton.next_power_of_2(heads),
            enable_fp_fusion=False,
        )
    return out


def _rotary_forward(q, k, cos, sin):
    return _rotate_forward(q, cos, sin), _rotate_forward(k, cos, sin)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (rotate-half) on q [B,S,Hq,D] and k [B,S,Hkv,D] with cos / sin [B,S,D]: one launch
    each, where the eager formula makes five kernels per tensor (`rotary_supported` first)."""
    return _run(_rotary_forward, formulas.rotary, (), q, k, cos, sin)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last axis, in x's dtype (fp32 or wider for the logprobs)."""
    return _run(_log_softmax_forward, _log_softmax_reference, (), x)
