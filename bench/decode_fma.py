"""A decode attention without tensor cores for one query head per KV head, timed beside the engine's.

    python bench/decode_fma.py              # bf16 and fp8 K/V, prompts of 100 and 1,000 tokens
    python bench/decode_fma.py --fp8 --prompts 1000

An experiment, not the engine's kernel. At Ouro's heads (16 query heads over 16 KV heads, G = 1)
the engine's decode kernel pads each program's single query row to the 16 rows a tensor-core dot
needs, so its scores and accumulator hold 16 rows of which one is used, and over packed fp8 rows
its P·V dot needs V transposed, which sm90 can only do for 8-bit data a byte at a time. This
kernel instead reads a tile's K and V rows as stored and reduces with multiply-adds: the scores
are each row's sum over the head dimension, the output each dimension's sum over the positions,
and no row is padded. Its summation order is not the engine's, so its outputs differ from the
engine's within bf16 rounding (the bench prints the largest difference); were it faster, taking
it into the engine would need the trainer's replay (kernels/replay_attention.py) to sum in the
same order.

It runs at bench/cascade.py's decode step (its options: by default 256 rows in 32 groups of 8,
256 positions past the prompt, K/V read only, no write, no cascade) for each variant of tile,
warps, accumulator (`acc2d`: a [tile, head_dim] accumulator reduced once at the end; otherwise
the tile's products are reduced every tile) and loads (`ahead`: a tile's loads issued while the
one before it is folded, as the engine's kernel pipelines them). It prints µs a call (20 calls
replayed from a CUDA graph) and the share of the bytes roofline at --bandwidth, which reads a
group's shared prompt blocks once. Not part of the test run; on a machine without CUDA it runs
the kernel under the Triton interpreter at a small shape and checks it against the engine's
kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter, before any kernel is decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

VARIANTS = [  # (tile, warps, acc2d, ahead)
    (64, 4, False, False),
    (64, 8, False, False),
    (128, 8, False, False),
    (32, 4, True, False),
    (64, 8, True, False),
    (32, 4, False, True),
    (64, 8, False, True),
]


@triton.jit
def _load_tile(k_head, v_head, ctx_row, start, length, d, stride_ks, D: tl.constexpr, BLOCK: tl.constexpr,
               PACKED: tl.constexpr):  # fmt: skip
    """The tile's K and V rows as stored ([BLOCK, D] codes or bf16) and, packed, each row's exponent
    byte k (its scale is 2^k); past the row's length: zeros."""
    n = start + tl.arange(0, BLOCK)
    ok = n < length
    slot = tl.load(ctx_row + n, mask=ok, other=0).to(tl.int64)
    rows = slot[:, None] * stride_ks + d[None, :]
    k = tl.load(k_head + rows, mask=ok[:, None], other=0)
    v = tl.load(v_head + rows, mask=ok[:, None], other=0)
    if PACKED:
        ke = tl.load(k_head + slot * stride_ks + D, mask=ok, other=0)
        ve = tl.load(v_head + slot * stride_ks + D, mask=ok, other=0)
    else:
        ke = tl.zeros([BLOCK], tl.uint8)
        ve = ke
    return k, ke, v, ve


@triton.jit
def _values(raw, e, PACKED: tl.constexpr):
    """Rows as fp32 values and each row's scale (1 unpacked)."""
    if PACKED:
        scale = ((e.to(tl.int8, bitcast=True).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32), scale
    return raw.to(tl.float32), tl.full(e.shape, 1.0, tl.float32)


@triton.jit
def _fma_decode_kernel(
    Q,
    K,
    V,
    CTX,
    LENS,
    OUT,
    scale,
    stride_qb,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_cb,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    PACKED: tl.constexpr,
    ACC2D: tl.constexpr,
    AHEAD: tl.constexpr,
):
    """One program per (row, KV head): the row's online softmax over its context, tile by tile,
    K and V rows read as stored (bf16, or packed fp8 rows of model/kv_quant.py: codes, then the
    int8 exponent k of the row's scale 2^k at byte D); with AHEAD each tile's loads are issued
    while the tile before it is folded."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + d).to(tl.float32) * scale
    length = tl.load(LENS + b)
    k_head = K + h * stride_kh
    v_head = V + h * stride_kh
    ctx_row = CTX + b * stride_cb
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    l_sum = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    if ACC2D:
        acc2 = tl.zeros([BLOCK, D], tl.float32)
    else:
        acc = tl.zeros([D], tl.float32)
    if AHEAD:
        k_raw, ke, v_raw, ve = _load_tile(k_head, v_head, ctx_row, 0, length, d, stride_ks, D, BLOCK, PACKED)
    for start in range(0, length, BLOCK):
        if AHEAD:
            k_now, ke_now, v_now, ve_now = k_raw, ke, v_raw, ve
            k_raw, ke, v_raw, ve = _load_tile(
                k_head, v_head, ctx_row, start + BLOCK, length, d, stride_ks, D, BLOCK, PACKED
            )
        else:
            k_now, ke_now, v_now, ve_now = _load_tile(
                k_head, v_head, ctx_row, start, length, d, stride_ks, D, BLOCK, PACKED
            )
        ok = start + tl.arange(0, BLOCK) < length
        k, k_scale = _values(k_now, ke_now, PACKED)
        s = tl.where(ok, tl.sum(k * q[None, :], 1) * k_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 0)
        v, v_scale = _values(v_now, ve_now, PACKED)
        p = p * v_scale
        if ACC2D:
            acc2 = acc2 * alpha + p[:, None] * v
        else:
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    if ACC2D:
        acc = tl.sum(acc2, 0)
    tl.store(OUT + b * stride_ob + h * stride_oh + d, (acc / l_sum).to(OUT.dtype.element_ty))


def fma_decode(q, k_plane, v_plane, ctx, lengths, tile: int, warps: int, acc2d: bool, ahead: bool) -> torch.Tensor:
    """Decode attention of q [B, H, D] over K/V planes [H, slots, D or packed row bytes] at the
    rows' context slots ctx [B, W] and lengths [B]; H query heads over H KV heads."""
    b, hq, d = q.shape
    assert k_plane.shape[0] == hq and k_plane.stride() == v_plane.stride() and k_plane.stride(-1) == 1
    o = torch.empty_like(q)
    _fma_decode_kernel[(b, hq)](
        q, k_plane, v_plane, ctx, lengths, o, d**-0.5,
        q.stride(0), q.stride(1), k_plane.stride(0), k_plane.stride(1), ctx.stride(0), o.stride(0), o.stride(1),
        D=d, BLOCK=tile, PACKED=k_plane.dtype == torch.uint8, ACC2D=acc2d, AHEAD=ahead, num_warps=warps,
    )  # fmt: skip
    return o


def name(variant) -> str:
    tile, warps, acc2d, ahead = variant
    return f"fma tile {tile} warps {warps}" + (" acc2d" if acc2d else "") + (" ahead" if ahead else "")


def check_on_cpu() -> None:
    """The kernel under the interpreter against the engine's, bf16 and fp8, at a small shape."""
    from ouro_cli.kernels.decode_attention import paged_decode_attention
    from ouro_cli.model import kv_quant

    g = torch.Generator().manual_seed(0)
    rows, heads, d, slots = 3, 2, 32, 200
    lengths = torch.tensor([1, 70, 133])
    ctx = torch.stack([torch.randperm(slots, generator=g)[:140] for _ in range(rows)])
    q = torch.randn(rows, heads, d, generator=g).bfloat16()
    planes = [torch.randn(heads, slots, d, generator=g).bfloat16() for _ in range(2)]
    for fp8 in (False, True):
        k, v = [kv_quant.pack(p) for p in planes] if fp8 else planes
        want = paged_decode_attention(q, k, v, ctx, lengths).float()
        for variant in VARIANTS:
            got = fma_decode(q, k, v, ctx, lengths, *variant).float()
            err = (got - want).abs().max().item()
            print(f"{'fp8' if fp8 else 'bf16'} {name(variant)}: max |diff| {err:.3g}")
            assert err < 2e-2, err


def time_step(q, k, v, ctx, lengths, nbytes: int, bandwidth: float, reps: int) -> None:
    """The engine's kernel, then each variant: µs a call, share of the roofline, and the largest
    difference from the engine's outputs."""
    from gemv import graph_time

    from ouro_cli.kernels.decode_attention import paged_decode_attention

    def line(label: str, us: float) -> str:
        return f"  {label:28s} {us:7.1f} µs  {nbytes / us / 1e-6 / bandwidth:5.2f} of the roofline"

    engine = paged_decode_attention(q, k, v, ctx, lengths)
    print(line("engine's kernel", graph_time(lambda i: paged_decode_attention(q, k, v, ctx, lengths), reps) * 1e6))
    for variant in VARIANTS:
        try:
            got = fma_decode(q, k, v, ctx, lengths, *variant)
            us = graph_time(lambda i, x=variant: fma_decode(q, k, v, ctx, lengths, *x), reps) * 1e6
        except Exception as error:  # noqa: BLE001 (a variant the compiler refuses is reported)
            print(f"  {name(variant)}: failed: {type(error).__name__}: {str(error)[:160]}")
            continue
        print(
            f"{line(name(variant), us)}  max |diff| {(got.float() - engine.float()).abs().max().item():.3g}", flush=True
        )


def main() -> None:
    from cascade import step_options, step_tensors

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[step_options()])
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s of the roofline (H100 SXM)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: the kernel under the interpreter against the engine's (no timing)")
        check_on_cpu()
        return
    for fp8 in (True,) if args.fp8 else (False, True):
        args.fp8 = fp8
        for prompt in args.prompts:
            t = step_tensors(prompt, args)
            (rows, length), (k, v) = t["ctx"].shape, t["planes"][:2]
            shared = prompt // args.block_size * args.block_size  # a group's full prompt blocks, read once
            positions = args.groups * shared + rows * (length - shared)
            nbytes = positions * 2 * k.shape[0] * k.shape[-1] * k.element_size()
            print(f"{'fp8' if fp8 else 'bf16'} prompt {prompt}, {rows} rows at position {length - 1}, attend only")
            time_step(t["q"], k, v, t["ctx"], t["lengths"], nbytes, args.bandwidth, args.reps)


if __name__ == "__main__":
    main()
