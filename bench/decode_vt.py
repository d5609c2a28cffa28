"""fp8 decode attention with V stored position-major within each block, timed beside V stored as rows.

    python bench/decode_vt.py               # prompts of 100 and 1,000 tokens, fp8 rows
    python bench/decode_vt.py --sass        # the two kernels' machine code for sm90 (no GPU needed)

An experiment, not the engine's kernel. The engine's fp8 cache stores each position's V as a row
of head_dim codes (model/kv_quant.py). The P·V dot sums over positions, so its V operand must run
over positions; sm90 has no transposing shared-memory load for 8-bit data, and the compiled
kernel reads that operand back one byte at a time (`LDS.U8`). Here a block's V is stored the
other way round, [head_dim, block_size] codes a block and KV head, with each position's scale
exponent beside it in a plane of its own, so a tile's V operand arrives with positions
contiguous. Both kernels are otherwise the same: one program per (row, KV head), the query
padded to the 16 rows a tensor-core dot needs, tiles of 64 positions, K as packed rows, each
row's power-of-two scale applied outside the dots as the engine's default mode does. Their
outputs are compared bit for bit.

It runs at bench/cascade.py's decode step (256 rows in 32 groups of 8, 256 positions past the
prompt, attend only, no write, no cascade) and prints µs a call (20 calls replayed from a CUDA
graph) for the engine's kernel, the rows kernel and the position-major kernel. `--sass`
compiles both for sm90 on any machine and counts their instructions and shared loads. Not part
of the test run; without CUDA (and without `--sass`) it checks the two kernels against each
other under the Triton interpreter at a small shape.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available() and "--sass" not in sys.argv:  # the interpreter, before any kernel is decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

TILE = 64
WARPS = 4
LABELS = ("V rows", "position-major V, tail zeroed", "position-major V, finite cache")
# the dots' operand dtype: bf16 on the GPU; fp32 under the interpreter, whose dot does not take bf16
DOT_T = tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16


@triton.jit
def _exp2(e):
    """An int8 exponent byte k as the fp32 2^k."""
    return ((e.to(tl.int8, bitcast=True).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _vt_decode_kernel(
    Q,
    K,
    V,
    VE,
    CTX,
    BLOCKS,
    LENS,
    OUT,
    scale,
    stride_qb,
    stride_kh,
    stride_vh,
    stride_eh,
    stride_cb,
    stride_bb,
    stride_ob,
    D: tl.constexpr,
    ROW: tl.constexpr,
    BS: tl.constexpr,
    TILE: tl.constexpr,
    VT: tl.constexpr,
    DOT_T: tl.constexpr,
):
    """One program per (row b, KV head h). K: packed rows [H, slots, ROW] (codes, exponent byte at
    D). V with VT (1 or 2): codes [H, blocks, D, BS] and exponent bytes VE [H, slots]; VT 0: packed
    rows as K. CTX [B, W] slot ids of the row's positions, BLOCKS [B, W / BS] their block ids."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    r = tl.arange(0, 16)
    q = tl.load(Q + b * stride_qb + h * D + r[:, None] * 0 + d[None, :], mask=r[:, None] == 0, other=0.0).to(DOT_T)
    length = tl.load(LENS + b)
    k_head = K + h * stride_kh
    v_head = V + h * stride_vh
    m = tl.full([16], float("-inf"), tl.float32)
    l_sum = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, D], tl.float32)
    for start in range(0, length, TILE):
        n = start + tl.arange(0, TILE)
        ok = n < length
        slot = tl.load(CTX + b * stride_cb + n, mask=ok, other=0).to(tl.int64)
        kc = tl.load(k_head + slot[:, None] * ROW + d[None, :], mask=ok[:, None], other=0)
        k_scale = _exp2(tl.load(k_head + slot * ROW + D, mask=ok, other=0))
        kv = kc.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DOT_T)
        s = tl.dot(q, tl.trans(kv)) * (k_scale * scale)[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if VT:
            v_scale = _exp2(tl.load(VE + h * stride_eh + slot, mask=ok, other=0))
            j = tl.arange(0, TILE // BS)
            o = tl.arange(0, BS)
            blk = tl.load(BLOCKS + b * stride_bb + start // BS + j, mask=start + j * BS < length, other=0)
            pos = start + j[None, :, None] * BS + o[None, None, :]
            ptr = v_head + blk.to(tl.int64)[None, :, None] * (D * BS) + d[:, None, None] * BS + o[None, None, :]
            # masked by block, so each block's BS codes load as one vector; past the length the
            # codes are zeroed (VT 1) or, in a cache whose every code is a finite e4m3 value, left
            # as they are for their zero weights (VT 2)
            vc = tl.load(ptr, mask=(start + j * BS < length)[None, :, None], other=0)
            if VT == 1:
                vc = tl.where(pos < length, vc, 0)
            vc = tl.reshape(vc, [D, TILE])
            vv = vc.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DOT_T)
            p = p * v_scale[None, :]
            acc = tl.dot(p.to(tl.bfloat16).to(DOT_T), tl.trans(vv), acc * alpha[:, None])
        else:
            v_scale = _exp2(tl.load(v_head + slot * ROW + D, mask=ok, other=0))
            vc = tl.load(v_head + slot[:, None] * ROW + d[None, :], mask=ok[:, None], other=0)
            vv = vc.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DOT_T)
            p = p * v_scale[None, :]
            acc = tl.dot(p.to(tl.bfloat16).to(DOT_T), vv, acc * alpha[:, None])
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(OUT + b * stride_ob + h * D + r[:, None] * 0 + d[None, :], out.to(tl.bfloat16), mask=r[:, None] == 0)


def position_major(v_rows: torch.Tensor, block_size: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed V rows [H, slots, ROW] as (codes [H, blocks, D, BS], exponent bytes [H, slots])."""
    h, slots, _ = v_rows.shape
    codes = v_rows[..., :d].reshape(h, slots // block_size, block_size, d).transpose(2, 3).contiguous()
    return codes, v_rows[..., d].contiguous()


def vt_decode(q, k_rows, v, ve, ctx, blocks, lengths, vt: int, block_size: int) -> torch.Tensor:
    """Decode attention of q [B, H, D] (one query head per KV head) over packed K rows and V
    (position-major codes and exponents with `vt` 1 or 2, packed rows with 0)."""
    b, h, d = q.shape
    o = torch.empty_like(q)
    _vt_decode_kernel[(b, h)](
        q, k_rows, v, ve, ctx, blocks, lengths, o, d**-0.5,
        q.stride(0), k_rows.stride(0), v.stride(0), ve.stride(0), ctx.stride(0), blocks.stride(0), o.stride(0),
        D=d, ROW=k_rows.shape[-1], BS=block_size, TILE=TILE, VT=vt, DOT_T=DOT_T, num_warps=WARPS,
    )  # fmt: skip
    return o


def inputs(rows, heads, d, block_size, lengths, ctx_blocks, device, seed=0):
    """Random packed planes, their position-major V, and the context tables."""
    from ouro_cli.model import kv_quant

    g = torch.Generator(device=device).manual_seed(seed)
    slots = (int(ctx_blocks.max()) + 1) * block_size
    k_rows, v_rows = (
        kv_quant.pack(torch.randn(heads, slots, d, device=device, dtype=torch.bfloat16, generator=g)) for _ in range(2)
    )
    v_codes, v_exp = position_major(v_rows, block_size, d)
    pos = torch.arange(ctx_blocks.shape[1] * block_size, device=device)
    ctx = (ctx_blocks[:, pos // block_size] * block_size + pos % block_size).to(torch.int32)
    q = torch.randn(rows, heads, d, device=device, dtype=torch.bfloat16, generator=g)
    return q, k_rows, v_rows, v_codes, v_exp, ctx.contiguous(), ctx_blocks.to(torch.int32).contiguous(), lengths


def check_on_cpu() -> None:
    """Both kernels under the interpreter: the same outputs, and near the engine's."""
    from ouro_cli.kernels.decode_attention import paged_decode_attention

    g = torch.Generator().manual_seed(0)
    rows, heads, d, bs = 3, 2, 32, 16
    blocks = torch.stack([torch.randperm(40, generator=g)[:12] for _ in range(rows)])
    lengths = torch.tensor([1, 70, 190], dtype=torch.int32)
    q, k_rows, v_rows, v_codes, v_exp, ctx, blocks, lengths = inputs(rows, heads, d, bs, lengths, blocks, "cpu")
    rows_out = vt_decode(q, k_rows, v_rows, v_rows, ctx, blocks, lengths, 0, bs)
    vt_out = vt_decode(q, k_rows, v_codes, v_exp, ctx, blocks, lengths, 1, bs)
    assert torch.equal(vt_out, vt_decode(q, k_rows, v_codes, v_exp, ctx, blocks, lengths, 2, bs))
    engine = paged_decode_attention(q, k_rows, v_rows, ctx.long(), lengths.long())
    print(f"rows against position-major: {'identical' if torch.equal(rows_out, vt_out) else 'DIFFERENT'}")
    print(f"rows against the engine: max |diff| {(rows_out.float() - engine.float()).abs().max().item():.3g}")
    assert torch.equal(rows_out, vt_out)
    assert (rows_out.float() - engine.float()).abs().max().item() < 2e-2


def sass() -> None:
    """Both kernels compiled for sm90: instructions, registers and shared-memory loads."""
    import collections

    from kernel_sass import OPCODE, tool
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _vt_decode_kernel
    for vt, label in enumerate(LABELS):
        constants = {"D": 128, "ROW": 144, "BS": 16, "TILE": TILE, "VT": vt, "DOT_T": tl.bfloat16}
        pointers = {"Q": "*bf16", "K": "*u8", "V": "*u8", "VE": "*u8", "CTX": "*i32", "BLOCKS": "*i32"}
        pointers |= {"LENS": "*i32", "OUT": "*bf16"}
        signature, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in constants:
                signature[name], constexprs[(i,)] = "constexpr", constants[name]
            elif name in pointers:
                signature[name], attrs[(i,)] = pointers[name], [["tt.divisibility", 16]]
            else:
                signature[name] = "fp32" if name == "scale" else "i32"
                if name.startswith("stride"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": WARPS, "maxnreg": 128},
        )
        code = OPCODE.findall(tool("nvdisasm", "-c", cubin=compiled.asm["cubin"]))
        usage = tool("cuobjdump", "--dump-resource-usage", cubin=compiled.asm["cubin"])
        memory = collections.Counter(op for op in code if op.startswith(("LD", "ST")))
        print(f"{label}: {len(code)} instructions, {usage.split('REG:')[1].split()[0]} "
              f"registers; " + ", ".join(f"{op} {n}" for op, n in memory.most_common()))  # fmt: skip


def time_prompt(prompt: int, args) -> None:
    """The engine's kernel and the three variants at `prompt`: µs a call, and their outputs."""
    from cascade import group_tables
    from gemv import graph_time

    from ouro_cli.kernels.decode_attention import paged_decode_attention

    bs = args.block_size
    length = prompt + args.response + 1
    table = torch.from_numpy(group_tables(args.groups, args.group_size, prompt, length, bs, seed=prompt))
    rows = table.shape[0]
    lengths = torch.full((rows,), length, dtype=torch.int32, device="cuda")
    q, k_rows, v_rows, v_codes, v_exp, ctx, blocks, lengths = inputs(
        rows, args.heads, args.head_dim, bs, lengths, table.cuda(), "cuda", seed=prompt
    )
    print(f"fp8 prompt {prompt}, {rows} rows at position {length - 1}, attend only")
    ctx64, len64 = ctx.long(), lengths.long()
    engine = paged_decode_attention(q, k_rows, v_rows, ctx64, len64)
    us = graph_time(lambda i: paged_decode_attention(q, k_rows, v_rows, ctx64, len64), args.reps) * 1e6
    label = "engine's kernel"
    print(f"  {label:34s} {us:7.1f} µs")
    outs = {}
    for vt, label in enumerate(LABELS):
        v, ve = (v_codes, v_exp) if vt else (v_rows, v_rows)
        outs[vt] = vt_decode(q, k_rows, v, ve, ctx, blocks, lengths, vt, bs)
        us = graph_time(lambda i, v=v, ve=ve, vt=vt: vt_decode(q, k_rows, v, ve, ctx, blocks, lengths, vt, bs),
                        args.reps) * 1e6  # fmt: skip
        diff = (outs[vt].float() - engine.float()).abs().max().item()
        print(f"  {label:34s} {us:7.1f} µs  max |diff| from the engine's {diff:.3g}", flush=True)
    same = all(torch.equal(outs[0], out) for out in outs.values())
    print(f"  the three kernels' outputs {'identical' if same else 'DIFFER'}")


def main() -> None:
    from cascade import step_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[step_options()])
    ap.add_argument("--sass", action="store_true", help="count the kernels' sm90 instructions, no GPU")
    args = ap.parse_args()
    if args.sass:
        sass()
    elif not torch.cuda.is_available():
        print("no CUDA: the kernels under the interpreter (no timing)")
        check_on_cpu()
    else:
        for prompt in args.prompts:
            time_prompt(prompt, args)


if __name__ == "__main__":
    main()
