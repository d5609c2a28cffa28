"""The decode write-and-attend kernel's tile (BLOCK positions) and warps, timed on CUDA.

    python bench/decode_attention.py                        # 1.4B heads, rows 8 16 64, 192 positions
    python bench/decode_attention.py --fp8 --rows 256 --positions 356 --blocks 16 32 64 128 --warps 2 4 8

For each number of rows and each (BLOCK, num_warps): µs per call of
kernels/decode_attention.write_kv_and_attend (bf16, or with --fp8 packed fp8 rows and the new
K/V unrounded, as the engine's decode layers hand them over; plane t > 0 so the carry-forward
reads run), 20 calls captured to a CUDA graph and replayed (gemv.graph_time), over a paged plane
of random slots; once every tile is timed, the tiles fastest first with the KV bytes read a
second and the ratio to the default tile. A row's bits depend on BLOCK and num_warps, so a
change of default changes the engine's and the paged replay's numbers together (they share the
constants). Not part of the test run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from gemv import graph_time  # noqa: E402

from ouro_cli.kernels import decode_attention as kernels  # noqa: E402
from ouro_cli.model import kv_quant  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--positions", type=int, default=192, help="context length of every row")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--fp8", action="store_true", help="packed fp8 rows (model/kv_quant.py)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/decode_attention.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    for rows in args.rows:
        bench_rows(rows, args)


def bench_rows(rows: int, args) -> None:
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(rows)
    hkv, d = args.kv_heads, args.head_dim
    slots = rows * args.positions * 2  # half the plane unused: slots are scattered as in a real cache
    k_planes = torch.randn(2, hkv, slots + 1, d, device=dev, dtype=dt, generator=g)
    v_planes = torch.randn(2, hkv, slots + 1, d, device=dev, dtype=dt, generator=g)
    ctx = torch.randperm(slots, device=dev, generator=g)[: rows * args.positions].view(rows, args.positions)
    lengths = torch.full((rows,), args.positions, device=dev)
    new = [torch.randn(rows, n, d, device=dev, dtype=dt, generator=g) for n in (args.heads, hkv, hkv)]
    kv_bytes = 2 * rows * hkv * args.positions * d * dt.itemsize
    if args.fp8:  # packed planes; the kernel packs the new K/V as the decode layers hand them over
        k_planes, v_planes = kv_quant.pack(k_planes), kv_quant.pack(v_planes)
        kv_bytes = 2 * rows * hkv * args.positions * kv_quant.row_bytes(d, 1, fp8=True)
    inputs = (
        new[0],
        k_planes[1],
        v_planes[1],
        k_planes[0],
        v_planes[0],
        ctx[:, -1].contiguous(),
        new[1],
        new[2],
        torch.ones(rows, dtype=torch.bool, device=dev),
        ctx,
        lengths,
    )
    kind = "fp8" if args.fp8 else "bf16"
    print(f"{kind} rows {rows}, {args.positions} positions, {hkv} kv heads x {d}: {kv_bytes / 1e6:.1f} MB of K/V")
    timed = {}
    for block, warps in itertools.product(args.blocks, args.warps):
        call = functools.partial(kernels.write_kv_and_attend, *inputs, block=block, num_warps=warps)
        try:
            timed[block, warps] = graph_time(lambda i, call=call: call(), args.reps) * 1e6
        except Exception as e:  # tiles that do not fit
            print(f"  BLOCK {block:3d} warps {warps}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        print(f"  BLOCK {block:3d} warps {warps}: {timed[block, warps]:6.1f} µs", flush=True)
    base = timed.get((kernels.BLOCK, kernels.NUM_WARPS))
    for (block, warps), us in sorted(timed.items(), key=lambda item: item[1]):
        ratio = f"  x{base / us:.2f} of the default" if base else ""
        print(f"  fastest first: BLOCK {block:3d} warps {warps}: {us:6.1f} µs  {kv_bytes / us / 1e3:6.0f} GB/s{ratio}")


if __name__ == "__main__":
    main()
