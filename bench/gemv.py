"""Small-M linear layers on CUDA: cuBLAS (F.linear) against the Triton kernel of
ouro_cli/kernels/gemv.py, at the decode step's shapes.

    python bench/gemv.py                                # Ouro-1.4B shapes, M = 8, 16, 64, bf16
    python bench/gemv.py --sweep --json gemv.json       # also a grid of tiles; results as JSON

For each of the five weight shapes of Ouro-1.4B (qkv, o_proj, gate_up, down, lm_head) and
each M: the time of one call of F.linear and of small_m_linear with its default tiles
(and, with --sweep, with every tile config of a small grid), as µs, weight GB/s (W bytes
/ time: the whole cost at such M) and the ratio to cuBLAS (> 1: faster). Each is timed as
the engine runs it: a CUDA graph of 20 back-to-back calls, replayed --reps times between
CUDA events after a warm-up. The calls cycle through copies of W that together exceed the
L2 several times over, so W comes from HBM as it does in a decode step (o_proj alone would
otherwise stay in L2 and read at L2 speed).

Then bitwise checks of the kernel's bf16 output: against F.linear at the same M, against
F.linear's rows when the same rows sit in an M = 96 input (the trainer's replay shape), and
against itself with each row alone (M = 1; this one must say identical). The kernel is not
expected to equal cuBLAS: it sums K in another order. Needs CUDA; `--sweep` compiles ~70
kernels, cached by Triton for the next run. Not part of the test run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

SHAPES = {
    "qkv": (6144, 2048),
    "o_proj": (2048, 2048),
    "gate_up": (11264, 2048),
    "down": (2048, 5632),
    "lm_head": (49152, 2048),
}
SWEEP = [
    {"block_n": n, "block_k": k, "num_warps": w, "num_stages": s}
    for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4))
]
CALLS = 20  # calls per CUDA graph


def graph_time(call, reps: int) -> float:
    """Seconds per call of call(i), i = 0..CALLS-1, captured back to back in one CUDA graph."""
    for i in range(CALLS):  # compile, and let cuBLAS pick its kernels, outside the capture
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(i)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * CALLS)


def compare(a: torch.Tensor, b: torch.Tensor) -> str:
    return "identical" if torch.equal(a, b) else f"max |diff| {(a.float() - b.float()).abs().max().item():.3g}"


def short(config: dict[str, int]) -> str:
    return "n{block_n} k{block_k} w{num_warps} s{num_stages}".format(**config)


def bench_shape(name: str, n: int, k: int, rows: list[int], sweep: bool, reps: int, l2_bytes: int) -> list[dict]:
    from ouro_cli.kernels.gemv import default_config, small_m_linear

    dtype = torch.bfloat16
    weight_bytes = n * k * dtype.itemsize
    copies = min(CALLS, max(1, math.ceil(4 * l2_bytes / weight_bytes)))
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5 for _ in range(copies)]
    x96 = torch.randn(96, k, device="cuda", dtype=dtype, generator=g)
    config = default_config(n, k, dtype)
    print(
        f"{name} [{n}, {k}]: {weight_bytes / 1e6:.1f} MB, {copies} copies; default {short(config)} "
        f"({-(-n // config['block_n'])} programs)",
        flush=True,
    )
    results = []

    def per_second(seconds: float) -> float:
        return weight_bytes / seconds / 1e9

    for m in rows:
        x = x96[:m]
        t_cublas = graph_time(lambda i, x=x: F.linear(x, ws[i % copies]), reps)
        t_triton = graph_time(lambda i, x=x: small_m_linear(x, ws[i % copies]), reps)
        row = {
            "shape": name,
            "n": n,
            "k": k,
            "m": m,
            "weight_bytes": weight_bytes,
            "cublas_us": t_cublas * 1e6,
            "cublas_gbs": per_second(t_cublas),
            "triton_us": t_triton * 1e6,
            "triton_gbs": per_second(t_triton),
            "triton_speedup": t_cublas / t_triton,
            "default_config": config,
        }
        print(
            f"  M={m:<3d} cuBLAS {t_cublas * 1e6:7.1f} µs {per_second(t_cublas):5.0f} GB/s | triton "
            f"{t_triton * 1e6:7.1f} µs {per_second(t_triton):5.0f} GB/s  x{t_cublas / t_triton:.2f}",
            flush=True,
        )
        if sweep:
            row["sweep"] = []
            for cfg in SWEEP:
                try:
                    t = graph_time(lambda i, x=x, cfg=cfg: small_m_linear(x, ws[i % copies], **cfg), reps)
                    row["sweep"].append({**cfg, "us": t * 1e6, "gbs": per_second(t)})
                except Exception as e:  # a config whose tiles do not fit in shared memory, most often
                    row["sweep"].append({**cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            best = min((r for r in row["sweep"] if "us" in r), key=lambda r: r["us"])
            row["best"] = {**best, "speedup": row["cublas_us"] / best["us"]}
            failed = sum("error" in r for r in row["sweep"])
            print(
                f"         best   {short(best)}: {best['us']:7.1f} µs {best['gbs']:5.0f} GB/s  "
                f"x{row['best']['speedup']:.2f}  ({len(SWEEP) - failed} configs ran, {failed} failed)",
                flush=True,
            )
        w = ws[0]
        got = small_m_linear(x, w)
        alone = torch.cat([small_m_linear(x[i : i + 1], w) for i in range(m)])
        row["vs_linear"] = compare(got, F.linear(x, w))
        row["vs_linear_m96"] = compare(got, F.linear(x96, w)[:m])
        row["linear_vs_linear_m96"] = compare(F.linear(x, w), F.linear(x96, w)[:m])
        row["vs_rows_alone"] = compare(got, alone)
        print(
            f"         bits: vs F.linear {row['vs_linear']}; vs F.linear M=96 rows {row['vs_linear_m96']} "
            f"(F.linear itself: {row['linear_vs_linear_m96']}); vs rows alone {row['vs_rows_alone']}",
            flush=True,
        )
        results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[8, 16, 64], help="rows of x (1..64)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help=f"also time {len(SWEEP)} tile configs per shape and M")
    ap.add_argument("--reps", type=int, default=10, help=f"graph replays timed ({CALLS} calls each)")
    ap.add_argument("--json", type=Path, help="write the results here (rewritten after every shape)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gemv.py needs a CUDA GPU (it times CUDA graphs); none found", file=sys.stderr)
        sys.exit(2)
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    print(
        f"{props.name}: {props.multi_processor_count} SMs, L2 {l2_bytes >> 20} MiB; bf16, "
        f"{CALLS} calls per graph x {args.reps} replays",
        flush=True,
    )
    start = time.perf_counter()
    report = {"device": props.name, "sms": props.multi_processor_count, "l2_bytes": l2_bytes, "rows": []}
    for name in args.shapes:
        report["rows"] += bench_shape(name, *SHAPES[name], args.m, args.sweep, args.reps, l2_bytes)
        torch.cuda.empty_cache()
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
