"""Exact mode's fixed-tile projections against cuBLAS at the rows users run (GPU).

    python bench/fixed_tile.py                 # the kernel as exact mode runs it, 1.4B projections
    python bench/fixed_tile.py --sweep         # also each candidate tile config, its bits checked

For each projection of Ouro-1.4B (fused qkv, o, fused gate·up, down, lm_head) and each row
count (8 and 64: decode; 256: a rollout's decode step of 128 sequences at K = 2; 4,096 and
16,384: a prefill group and a trainer micro-batch), the model TFLOP/s of
`fixed_tile_linear` and of F.linear (cuBLAS), their ratio, and the fraction of the H200's
dense bf16 peak (780 TFLOP/s). The last rows sum each over the five projections: the
time of one layer's projections at that row count.

`--sweep` times every tile config of CANDIDATES on the same operands and says whether its
output equals, bit for bit, the base config's (kernels/fixed_tile.py `BASE`) at every
shape: exact mode may pick its config by the row count only among configs whose bits are
the same, since a row's bits must not depend on how many rows share its call
(docs/exact.md). Medians of --repeats CUDA-event timings after a warm-up, each call replayed
in a CUDA graph as the engine's decode step replays it (`--eager`: launched from Python, host
launch cost included; the first sweep, docs/log/performance.md 2026-12-02, ran that way).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ouro_cli.kernels import fixed_tile  # noqa: E402

PEAK = 780e12
PROJECTIONS = {
    "qkv": (6144, 2048),
    "o": (2048, 2048),
    "gate_up": (11264, 2048),
    "down": (2048, 5632),
    "lm_head": (49152, 2048),
}
ROWS = (8, 64, 256, 4096, 16384)
# (BLOCK_M, BLOCK_N, warps, stages): BLOCK_K stays the dtype's (fixed_tile.block_k)
CANDIDATES = (
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (128, 64, 4, 3),
    (128, 128, 4, 3),
    (128, 128, 8, 3),
    (128, 256, 8, 3),
    (128, 256, 8, 4),
    (256, 128, 8, 3),
    (64, 256, 4, 3),
    # smaller tiles and deeper pipelines for a decode step's 64-512 rows
    (32, 64, 4, 3),
    (32, 128, 4, 3),
    (64, 64, 4, 4),
    (64, 128, 4, 4),
    (128, 64, 8, 3),
    (64, 64, 2, 4),
)


GRAPH_CALLS = 10  # calls of `fn` per captured graph


def timed(fn, repeats: int, graph: bool = True) -> float:
    """Median seconds of one `fn()` over `repeats` CUDA-event timings, after two warm-up calls.
    With `graph`, GRAPH_CALLS calls are captured in a CUDA graph and each timing is one replay
    divided by them: the kernels' own time, as the decode step replays them, without the host's
    launch cost (Triton's Python launcher costs tens of µs a call, more than a projection at a
    few hundred rows takes on the device)."""
    for _ in range(2):
        fn()
    run, calls = fn, 1
    if graph:
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(GRAPH_CALLS):
                fn()
        run, calls = captured.replay, GRAPH_CALLS
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def operands(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    return x, w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also time each candidate tile config and check its bits")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--eager", action="store_true", help="time each call as launched from Python, not replayed in a CUDA graph"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: bench/fixed_tile.py needs a CUDA device")
    configs = CANDIDATES if args.sweep else ()
    total: dict[tuple[str, int], float] = {}
    flops_at: dict[int, float] = {}
    print(
        f"{'proj':8} {'rows':>6} | {'exact TF/s':>10} {'cuBLAS TF/s':>11} {'ratio':>6} {'of peak':>7}"
        + "".join(f" | {'x'.join(map(str, c)):>12}" for c in configs)
    )
    for name, (n, k) in PROJECTIONS.items():
        for m in args.rows:
            x, w = operands(m, n, k)
            flops = 2 * m * n * k
            flops_at[m] = flops_at.get(m, 0) + flops
            ours = timed(lambda x=x, w=w: fixed_tile.fixed_tile_linear(x, w), args.repeats, not args.eager)
            cublas = timed(lambda x=x, w=w: torch.nn.functional.linear(x, w), args.repeats, not args.eager)
            total["exact", m] = total.get(("exact", m), 0) + ours
            total["cublas", m] = total.get(("cublas", m), 0) + cublas
            line = (
                f"{name:8} {m:6d} | {flops / ours / 1e12:10.1f} {flops / cublas / 1e12:11.1f} "
                f"{cublas / ours:6.2f} {flops / ours / PEAK:7.2f}"
            )
            base = fixed_tile.launch(x, w, fixed_tile.BASE) if configs else None
            for config in configs:
                try:
                    t = timed(lambda c=config, x=x, w=w: fixed_tile.launch(x, w, c), args.repeats, not args.eager)
                    same = torch.equal(fixed_tile.launch(x, w, config), base)
                    line += f" | {flops / t / 1e12:7.1f} {'same' if same else 'DIFF'}"
                    total[config, m] = total.get((config, m), 0) + t
                except Exception as err:  # a config the compiler cannot fit (shared memory)
                    line += f" | {type(err).__name__[:12]:>12}"
            print(line, flush=True)
    print("\nall five projections, one layer:")
    for m in args.rows:
        line = (
            f"  rows {m:6d}: exact {flops_at[m] / total['exact', m] / 1e12:6.1f} TF/s, cuBLAS "
            f"{flops_at[m] / total['cublas', m] / 1e12:6.1f} TF/s, exact / cuBLAS time "
            f"{total['exact', m] / total['cublas', m]:.2f}"
        )
        for config in configs:
            if (config, m) in total:
                line += f"; {'x'.join(map(str, config))} {flops_at[m] / total[config, m] / 1e12:.0f}"
        print(line)


if __name__ == "__main__":
    main()
