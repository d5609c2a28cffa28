"""Where a decode step's time goes: kernels per step, GPU-busy time, and the top kernels.

    python bench/decode_profile.py --batch 1 16 64 --loops 4     # CUDA, Ouro-1.4B shape, random bf16
    python bench/decode_profile.py --batch 256 -K 2 --prompt 280 --steps 48 --host-profile --timeline --no-eager
    python bench/decode_profile.py --batch 256 --prompt 100 --group-size 8 --kv-cache-dtype fp8 --timeline --no-eager

For each batch: the step time with CUDA graphs (what decoding runs), the widest captured
graph replayed alone (the step minus that is host time the overlap did not hide), then one eager
step under torch.profiler: how many kernels it launches, the sum of their GPU times,
and the kernels that take the most. Graph replay removes launch gaps but not kernels,
so `graph step ≈ GPU-busy time + kernels × per-kernel floor`; comparing the two with
the weight-read roofline says whether a step is bound by bytes or by kernel count.
`--host-profile` (cProfile) and `--timeline` (torch.profiler: GPU busy time against wall
time, every kernel in and outside the graphs) cover the decode steps of a graph-mode
generate after its last prefill chunk; `--steps` must exceed the prefill's chunks.
`--group-size G` gives every G samples one prompt, as a GRPO group does (their prompt blocks
shared and read once per group by the cascade), and `--kv-cache-dtype fp8` puts the engine on
packed fp8 K/V; the roofline then counts each group's prompt once and fp8's row bytes.
Not part of the test run.
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import decode as decode_bench  # noqa: E402
from kernel_table import cuda_kernels, print_kernel_table  # noqa: E402
from train_host_profile import print_top  # noqa: E402

from ouro_cli.engine import LLM, SamplingParams  # noqa: E402
from ouro_cli.engine.runner import batch_bucket  # noqa: E402
from ouro_cli.model import OuroConfig, kv_quant  # noqa: E402

GROUP = 1  # samples per prompt (--group-size): every prompt list below is made by `prompts`
ENGINE: dict = {}  # the engines' extra arguments (--kv-cache-dtype fp8: the execution settings)


def prompts(batch: int, prompt: int, vocab: int) -> list[list[int]]:
    return decode_bench.make_prompts(batch, prompt, vocab, GROUP)


def step_time(llm: LLM, batch: int, prompt: int, k: int, steps: int, vocab: int) -> float:
    """Seconds per decode step: (steps + 1)-token run minus a 1-token run, over `steps`."""
    return decode_bench.measure(llm, batch, prompt, steps, k, vocab, "cuda", GROUP) / steps


def roofline_step_ms(
    config: OuroConfig, k: int, batch: int, prompt: int, steps: int, fp8: bool, bandwidth: float
) -> float:
    """The bytes roofline of a mean timed step: the layer weights K times, and each row's K/V in K
    planes over its context, the `prompt` (a group's counted once: the cascade reads it once per
    group) and the row's own positions (`steps` / 2 on average over the timed steps), in fp8's
    packed row bytes or bf16's."""
    d = config.dim_per_head
    elem = kv_quant.row_bytes(d, 1, fp8=True) / d if fp8 else 2
    context = prompt / GROUP + steps / 2
    kv = batch * context * k * config.num_hidden_layers * 2 * config.num_key_value_heads * d * elem
    return (k * decode_bench.layer_weight_bytes(config, 2) + kv) / bandwidth * 1e3


def replay_time(llm: LLM, batch: int, repeats: int = 20) -> tuple[float, tuple[int, int, int]] | None:
    """Seconds of one replay of this batch's widest captured decode graph, back to back with
    nothing between: the GPU's share of a step. The step time minus this is what the host
    adds (sampling, reading tokens back, emitting, the next step's inputs) that overlap
    does not hide."""
    graphs = llm.runner.graphs or {}
    keys = [key for key in graphs if key[0] == batch_bucket(batch)]
    if not keys:
        return None
    key = max(keys, key=lambda k: k[1])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graphs[key].graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats, key


def eager_profile(model, batch: int, prompt: int, k: int, vocab: int, top: int) -> None:
    blocks = batch * (-(-(prompt + 8) // 16))
    llm = LLM(model, max_num_seqs=batch, kv_blocks=blocks, block_size=16, cuda_graphs=False, **ENGINE)
    batch_prompts = prompts(batch, prompt, vocab)
    params = SamplingParams(max_tokens=4, max_loops=k, temperature=1.0, seed=0, ignore_eos=True)
    llm.generate(batch_prompts, params)  # compile and warm up
    runner = llm.runner
    calls = []
    original = runner.decode

    def timed(*args, **kw):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = original(*args, **kw)
            torch.cuda.synchronize()
        calls.append(prof)
        return out

    runner.decode = timed
    llm.generate(batch_prompts, params)
    llm.close()
    prof = calls[-1]
    kernels = cuda_kernels(prof)
    busy_us = sum(e.device_time for e in kernels)
    print(
        f"  eager step: {len(kernels)} kernels ({len(kernels) / (k * len(model.model.layers)):.1f} per layer-loop), "
        f"GPU busy {busy_us / 1e3:.2f} ms"
    )
    print_kernel_table(kernels, top, indent="    ")


def _decode_steps(llm: LLM, batch: int, prompt: int, k: int, steps: int, vocab: int, begin, end) -> tuple[float, int]:
    """Run a warm-up generate, then one more in which `begin()` is called at its first decode
    call after every prompt is prefilled (prefill runs in chunks between decode steps, which
    the profile leaves out) and `end()` once it returns. Returns (seconds in between, decode
    steps in between); `steps` must exceed the prefill's chunks for any to be left."""
    batch_prompts = prompts(batch, prompt, vocab)
    params = SamplingParams(max_tokens=steps + 1, max_loops=k, temperature=1.0, seed=0, ignore_eos=True)
    llm.generate(batch_prompts, params)
    core = llm.core
    prefill, decode, launch = core.prefill, core.decode, core.launch_decode
    prefilled, started, launched = [0], [], [0]

    def counted_prefill(seqs, *args, **kw):
        prefilled[0] += len(seqs)
        return prefill(seqs, *args, **kw)

    def first_begins(*args, **kw):
        if not started and prefilled[0] >= batch:
            torch.cuda.synchronize()
            started.append(time.perf_counter())
            begin()
        return decode(*args, **kw)

    def counted_launch(*args, **kw):
        launched[0] += bool(started)
        return launch(*args, **kw)

    core.prefill, core.decode, core.launch_decode = counted_prefill, first_begins, counted_launch
    try:
        llm.generate(batch_prompts, params)
        torch.cuda.synchronize()
        if started:
            end()
    finally:
        del core.prefill, core.decode, core.launch_decode
    if not started or not launched[0]:
        raise SystemExit(f"no decode step of all {batch} rows: raise --steps above the prefill's chunks")
    return time.perf_counter() - started[0], launched[0]


def host_profile(llm: LLM, batch: int, prompt: int, k: int, steps: int, vocab: int, top: int) -> None:
    """cProfile of a graph-mode generate's decode steps, the whole host loop (scheduler, input
    building, sampling launches, reading tokens back, emitting outputs), prefill excluded: where
    the host spends a step's time. Host time that the overlap does not hide behind the GPU's
    captured step adds to every step. Printed by own time and by cumulative time."""
    prof = cProfile.Profile()
    wall, steps = _decode_steps(llm, batch, prompt, k, steps, vocab, prof.enable, prof.disable)
    print(
        f"  host profile (graph mode, {steps} decode steps, {wall * 1e3 / steps:.2f} ms per step "
        f"under cProfile; times in s):"
    )
    print_top(prof, top, indent="    ")


def timeline(llm: LLM, batch: int, prompt: int, k: int, steps: int, vocab: int, top: int) -> None:
    """torch.profiler over a graph-mode generate's decode steps (prefill excluded): the GPU's
    busy time beside the wall time, and every kernel it ran, the graphs' and those launched
    outside them (sampling), by total time. Wall minus busy is time the GPU waited for the host."""
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    wall, steps = _decode_steps(llm, batch, prompt, k, steps, vocab, prof.start, prof.stop)
    kernels = cuda_kernels(prof)
    busy_us = sum(e.device_time for e in kernels)
    print(
        f"  timeline ({steps} decode steps): {wall * 1e3 / steps:.2f} ms per step under the profiler, "
        f"GPU busy {busy_us / 1e3 / steps:.2f} ms per step ({busy_us / 1e6 / wall:.0%})"
    )
    print_kernel_table(kernels, top, indent="    ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--loops", "-K", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=192, help="prompt tokens a row (the profiled steps decode past them)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--bandwidth", type=float, default=4.26e12)
    ap.add_argument("--host-profile", action="store_true", help="also cProfile a graph-mode generate")
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="also torch.profiler a graph-mode generate: GPU busy against wall, kernels by time",
    )
    ap.add_argument("--no-eager", action="store_true", help="skip the eager kernel profile")
    ap.add_argument("--no-overlap", action="store_true", help="decode one step at a time (LLM(overlap=False))")
    ap.add_argument("--group-size", type=int, default=1, help="samples per prompt (a GRPO group's)")
    ap.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16")
    args = ap.parse_args()
    global GROUP, ENGINE
    GROUP = args.group_size
    config = OuroConfig()
    torch.manual_seed(0)
    model = decode_bench.random_model(config, torch.bfloat16, "cuda")
    fp8 = args.kv_cache_dtype == "fp8"
    if fp8:
        ENGINE = {"execution": replace(model.execution, kv_cache_dtype="fp8")}
    weights_ms = args.loops * decode_bench.layer_weight_bytes(config, 2) / args.bandwidth * 1e3
    print(
        f"1.4B bf16 K={args.loops}: layer weights alone take {weights_ms:.2f} ms per step at {args.bandwidth:.3g} B/s"
    )
    for batch in args.batch:
        start = time.perf_counter()
        blocks = batch * -(-(args.prompt + args.steps + 2) // 16)
        llm = LLM(model, max_num_seqs=batch, kv_blocks=blocks, block_size=16, overlap=not args.no_overlap, **ENGINE)
        seconds = step_time(llm, batch, args.prompt, args.loops, args.steps, config.vocab_size)
        replay = replay_time(llm, batch)
        if args.host_profile:
            host_profile(llm, batch, args.prompt, args.loops, args.steps, config.vocab_size, args.top)
        if args.timeline:
            timeline(llm, batch, args.prompt, args.loops, args.steps, config.vocab_size, args.top)
        llm.close()
        roof = roofline_step_ms(config, args.loops, batch, args.prompt, args.steps, fp8, args.bandwidth)
        print(
            f"batch {batch}: graph step {seconds * 1e3:.2f} ms ({batch / seconds:.0f} tok/s); roofline step "
            f"{roof:.2f} ms"
        )
        if replay is not None:
            print(
                f"  graph {replay[1]} replayed alone: {replay[0] * 1e3:.2f} ms; the host adds "
                f"{(seconds - replay[0]) * 1e3:.2f} ms per step (overlap {'on' if llm.overlap else 'off'})"
            )
        if not args.no_eager:
            eager_profile(model, batch, args.prompt, args.loops, config.vocab_size, args.top)
        print(f"  ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
