"""The cascade decode attention (a group's shared prompt read once) against the plain kernel, on CUDA.

    python bench/cascade.py                       # 1.4B heads, 32 groups of 8, prompts 100 and 1000
    python bench/cascade.py --fp8                 # over packed fp8 rows (the write packs them)

For each prompt length: µs per call of kernels/decode_attention.write_kv_and_attend (bf16,
plane t > 0, every row active; with --fp8 over packed planes, the new K/V rounded as a layer
hands them over and packed by the kernel), 20 calls captured to a CUDA graph and replayed
(gemv.graph_time), with the cascade off and on (its prefix pass included), the attention's
tokens/s at 24 layers × 4 loops (rows / (µs per call × 96)), the ratio, and the host's µs per
step for the plan (engine/cascade.py). Rows of a group reference the same prompt blocks
(16-token blocks, ids shuffled) and sit `--response` positions past it. The outputs are
checked equal bit for bit. Not part of the test run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from gemv import graph_time  # noqa: E402

from ouro_cli.engine.cascade import MIN_TILES, cascade_plan  # noqa: E402

LAYER_LOOPS = 24 * 4  # attention calls per decode step of Ouro-1.4B at K = 4


def step_options() -> argparse.ArgumentParser:
    """The decode step's options (shape, K/V dtype, prompts, replays), for this bench and those
    that time the same step (bench/kernel_options.py) as a parent parser."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--response", type=int, default=256, help="each row's position past its prompt")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16, help="the KV cache's tokens per block")
    ap.add_argument("--fp8", action="store_true", help="packed fp8 rows (model/kv_quant.py)")
    ap.add_argument("--reps", type=int, default=20)
    return ap


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[step_options()]).parse_args()
    if not torch.cuda.is_available():
        print("bench/cascade.py needs a CUDA GPU: skipped", file=sys.stderr)
        return
    for prompt in args.prompts:
        bench_prompt(prompt, args)


def group_tables(groups: int, size: int, prompt: int, length: int, bs: int, seed: int) -> np.ndarray:
    """Block tables [groups × size, blocks]: each group's full prompt blocks shared, the rest
    each row's own, every id drawn from a shuffled range."""
    shared = prompt // bs
    blocks = -(-length // bs)
    rng = np.random.default_rng(seed)
    ids = iter(rng.permutation(groups * (shared + size * (blocks - shared))).tolist())
    table = np.zeros((groups * size, blocks), dtype=np.int64)
    for g in range(groups):
        prefix = [next(ids) for _ in range(shared)]
        for r in range(size):
            table[g * size + r] = prefix + [next(ids) for _ in range(blocks - shared)]
    return table


def bench_prompt(prompt: int, args) -> None:
    from ouro_cli.kernels import decode_attention as kernels

    call, cascade, rows, length, plan_us = setup(prompt, args)
    out = call(None)
    same = torch.equal(out, call(cascade))
    us = {n: graph_time(lambda i, c=c: call(c), args.reps) * 1e6 for n, c in (("off", None), ("on", cascade))}
    print(
        f"prompt {prompt}, position {length - 1}, {args.groups} groups of {args.group_size} ({rows} rows), "
        f"{args.heads}/{args.kv_heads} heads x {args.head_dim}, {'fp8' if args.fp8 else 'bf16'} write+attend: "
        f"plan {plan_us:.0f} µs a step on the host, outputs {'identical' if same else 'DIFFER'}"
    )
    for name, t in us.items():
        print(f"  cascade {name:3s}: {t:7.1f} µs a call  {rows / (t * LAYER_LOOPS) * 1e6:9.0f} tok/s of attention")
    engine = (
        "on"
        if prompt // args.block_size * args.block_size // kernels.BLOCK >= MIN_TILES
        else "off (below engine/cascade.py MIN_TILES)"
    )
    print(f"  speedup (off / on): x{us['off'] / us['on']:.2f}; in the engine at this prompt: {engine}", flush=True)


def step_tensors(prompt: int, args) -> dict:
    """The bench's decode step at `prompt` (args: bench/cascade.py's options) as tensors: the rows'
    queries `q`, the `planes` (t - 1's K and V, then t's), the context slots `ctx`, the `lengths`,
    the step's `k_new`, `v_new`, `new_slots`, `active`, and the block `table`."""
    from ouro_cli.model import kv_quant

    dev, dt, bs = "cuda", torch.bfloat16, args.block_size
    rows, hkv, d = args.groups * args.group_size, args.kv_heads, args.head_dim
    length = prompt + args.response + 1
    table = group_tables(args.groups, args.group_size, prompt, length, bs, seed=prompt)
    num_slots = (int(table.max()) + 1) * bs
    pos = torch.arange(length)
    ctx = (torch.from_numpy(table)[:, pos // bs] * bs + pos % bs).to(dev)
    g = torch.Generator(device=dev).manual_seed(prompt)
    planes = torch.randn(4, hkv, num_slots, d, device=dev, dtype=dt, generator=g)
    q = torch.randn(rows, args.heads, d, device=dev, dtype=dt, generator=g)
    k_new, v_new = (torch.randn(rows, hkv, d, device=dev, dtype=dt, generator=g) for _ in range(2))
    if args.fp8:  # packed planes; the new K/V as the layer hands them over (rounded)
        planes = [kv_quant.pack(p) for p in planes]
        k_new, v_new = kv_quant.round_trip(k_new), kv_quant.round_trip(v_new)
    return {
        "q": q,
        "planes": planes,
        "ctx": ctx,
        "lengths": torch.full((rows,), length, device=dev),
        "k_new": k_new,
        "v_new": v_new,
        "new_slots": ctx[:, -1].contiguous(),
        "active": torch.ones(rows, dtype=torch.bool, device=dev),
        "table": table,
    }


def setup(prompt: int, args):
    """The bench's decode step at `prompt` (args: bench/cascade.py's options): `call(cascade)`, a
    write + attend over the step's rows (cascade None: off), the cascade tables, the rows, the
    rows' length and the host's µs for the cascade plan."""
    from ouro_cli.kernels import decode_attention as kernels

    t = step_tensors(prompt, args)
    rows, length = t["q"].shape[0], t["ctx"].shape[1]
    positions = np.full(rows, length - 1)
    per = kernels.queries_per_program(args.heads // args.kv_heads)
    start = time.perf_counter()
    for _ in range(100):
        plan = cascade_plan(t["table"], positions, args.block_size, kernels.BLOCK, per)
    plan_us = (time.perf_counter() - start) / 100 * 1e6
    cascade = kernels.Cascade.from_plan(torch.from_numpy(plan).to("cuda"), args.heads, args.head_dim)
    planes = t["planes"]

    def call(with_cascade):
        return kernels.write_kv_and_attend(
            t["q"], planes[2], planes[3], planes[0], planes[1], t["new_slots"], t["k_new"], t["v_new"], t["active"],
            t["ctx"], t["lengths"], cascade=with_cascade,
        )  # fmt: skip

    return call, cascade, rows, length, plan_us


if __name__ == "__main__":
    main()
