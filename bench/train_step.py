"""Benchmark one GRPO training step of the Megatron-core trainer: tokens/s and model TFLOP/s.

    python bench/train_step.py --shape tiny --device cpu
    python bench/train_step.py --shape 1.4b --device cuda --samples 8 --prompt-len 256 --response-len 768 --recompute
    python bench/train_step.py --shape 1.4b --device cuda --samples 8 --prompt-len 256 --response-len 768 --profile 25
    python bench/train_step.py --shape 1.4b --device cuda --samples 26 --prompt-len 18 --response-len 512 --depths 2 \\
        --profile 25
    python bench/train_step.py --shape 1.4b --device cuda --samples 256 --prompt-len 18 --response-len 512 --depths 2 \
        --max-tokens-per-micro-batch 12032 --prompt-heads    # one e2e K = 2 update's train step (without: as before)
    torchrun --nproc-per-node 8 bench/train_step.py --shape 1.4b --device cuda   # per-rank batch

Random weights at the chosen shape, random prompt/response tokens, and exit depths that
are all T (`--depths full`, the reference setting), drawn uniformly from 1..T
(`--depths random`), or one K (`--depths 2`: a fixed-budget rollout's, the prompt at T). Each timed step is a full
`Trainer.train_step`: replay forward,
GRPO loss, backward, DDP sync, clipping, Adam, LR schedule.

FLOP accounting (per step, summed over ranks):
- model FLOPs: 3 × the forward FLOPs the depths require (backward = 2 × forward):
  per layer-token evaluation 2 × (matmul parameters of a layer) plus causal attention
  4 × visible keys × q width, plus the LM head 2 × hidden × vocab at every position.
  Padding, skipped-but-computed loops and recompute are not counted: this is the
  number to compare with the reference (≈221 model TFLOP/s at 7,041 tok/s, docs/performance.md#how-to-read-it);
- executed TFLOP/s (matmuls only) counts what the replay really ran (`layer_tokens_executed`: each
  loop on the positions it ran, padding and exited positions included where it runs them all,
  and the recompute forward).
Not a test: bench/ is outside pytest's testpaths. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def model_config(shape: str):
    from ouro_cli.model import OuroConfig, tiny_config

    return tiny_config() if shape == "tiny" else OuroConfig()  # OuroConfig defaults are Ouro-1.4B


def layer_matmul_params(c) -> int:
    d = c.dim_per_head
    attn = c.hidden_size * d * (c.num_attention_heads * 2 + c.num_key_value_heads * 2)
    return attn + 3 * c.hidden_size * c.intermediate_size


def forward_flops(samples, c, *, executed: dict | None = None) -> float:
    """Forward FLOPs the depths require (see module docstring)."""
    per_layer_token = 2 * layer_matmul_params(c)
    q_width = c.num_attention_heads * c.dim_per_head
    total = 0.0
    for s in samples:
        depths = s.depths(c.num_loops)
        for pos, d in enumerate(depths):
            total += d * c.num_hidden_layers * (per_layer_token + 4 * (pos + 1) * q_width)
        total += len(depths) * 2 * c.hidden_size * c.vocab_size
    return total


def make_samples(c, n, prompt_len, response_len, depths, rng):
    from ouro_cli.trainer import Sample

    T = c.num_loops
    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, c.vocab_size) for _ in range(prompt_len)]
        response = [rng.randrange(3, c.vocab_size) for _ in range(response_len)]

        def depth() -> int:
            return T if depths == "full" else rng.randint(1, T) if depths == "random" else int(depths)

        exits = [T] + [depth() for _ in range(response_len - 1)]
        logprobs = [-rng.uniform(0.5, 4.0) for _ in range(response_len)]
        out.append(Sample(prompt, response, exits, logprobs, rng.uniform(-1, 1)))
    return out


def build_trainer(
    shape: str,
    device: str,
    dtype: str = "auto",
    *,
    micro_batch_size: int | None = None,
    pack: bool = True,
    pack_length: int | None = None,
    recompute: bool = False,
    distributed_optimizer: bool = False,
    deterministic: bool = True,
    model=None,
    max_tokens: int | None = None,
    prompt_heads: bool = False,
    exact: bool = False,
):
    """A Trainer on a random model of `shape` (or on `model`, adopted). Returns (trainer, setup seconds).
    `max_tokens` cuts each step into micro-batches as `ouro train` does (counted at full depth,
    rl/sizing.py token_cost_shares); `prompt_heads` splits fixed-budget samples as it does;
    `exact` replays in exact mode (docs/exact.md)."""
    from ouro_cli.model import build
    from ouro_cli.rl.sizing import token_cost_shares
    from ouro_cli.trainer import Trainer, TrainerConfig

    cost = token_cost_shares(model_config(shape), recompute, exact) if max_tokens else None
    config = TrainerConfig(
        device=device,
        params_dtype=dtype,
        lr=1e-6,
        micro_batch_size=micro_batch_size,
        pack=pack,
        pack_length=pack_length,
        recompute=recompute,
        use_distributed_optimizer=distributed_optimizer,
        deterministic=deterministic,
        max_tokens_per_micro_batch=max_tokens,
        micro_batch_token_cost=cost,
        prompt_heads=prompt_heads,
    )
    t0 = time.perf_counter()
    if model is None:
        # Build in the parameter dtype, directly on the device: a 1.4B fp32 copy on the host is slow.
        model = build(model_config(shape), dtype=config.torch_dtype, device=config.resolved_device, seed=0)
    trainer = Trainer(model, config, exact=exact)
    return trainer, time.perf_counter() - t0


def measure_steps(
    trainer,
    shape: str,
    *,
    samples: int,
    prompt_len: int,
    response_len: int,
    depths: str = "full",
    steps: int = 5,
    warmup: int = 2,
) -> dict:
    """Time `steps` full train steps after `warmup` ones on random samples; the result dict (see module docstring)."""
    import torch

    c = model_config(shape)
    rng = random.Random(trainer.context.rank)
    batches = [make_samples(c, samples, prompt_len, response_len, depths, rng) for _ in range(warmup + steps)]

    def sync():
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()

    for batch in batches[:warmup]:
        trainer.train_step(batch)
    sync()
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, metrics = [], []
    for batch in batches[warmup:]:
        start = time.perf_counter()
        metrics.append(trainer.train_step(batch))
        sync()
        times.append(time.perf_counter() - start)

    world = trainer.context.world_size
    step_s = sorted(times)[len(times) // 2]  # median
    last = metrics[-1]
    tokens = last["tokens"]  # summed over ranks
    model_flops = 3 * forward_flops(batches[-1], c) * world
    per_loop_layer_token = 2 * layer_matmul_params(c)
    executed_flops = (
        last["layer_tokens_executed"] * 3 + last["layer_tokens_recomputed"]
    ) * per_loop_layer_token + 3 * last["padded_tokens"] * 2 * c.hidden_size * c.vocab_size
    config = trainer.config
    result = {
        "shape": shape,
        "device": trainer.device.type,
        "dtype": str(config.torch_dtype).removeprefix("torch."),
        "world_size": world,
        "samples_per_rank": samples,
        "prompt_len": prompt_len,
        "response_len": response_len,
        "depths": depths,
        "recompute": config.recompute,
        "micro_batch_size": config.micro_batch_size,
        "pack": config.pack,
        "step_s_median": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in times],
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / step_s, 1),
        "model_tflops_per_s": round(model_flops / step_s / 1e12, 4),
        "executed_tflops_per_s": round(executed_flops / step_s / 1e12, 4),
        "executed_over_required_layer_tokens": round(last["layer_tokens_executed"] / last["layer_tokens_required"], 3),
        "forward_backward_s": round(last["forward_backward_s"], 4),
        "optimizer_s": round(last["optimizer_s"], 4),
    }
    if trainer.device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["tiny", "1.4b"], default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--samples", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--pack-length", type=int, default=None)
    parser.add_argument("--no-pack", action="store_true")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument(
        "--depths",
        choices=["full", "random", "1", "2", "3", "4"],
        default="full",
        help="response exit depths: all T, uniform in 1..T, or one K (bench/e2e.py's rollouts)",
    )
    parser.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        default=None,
        help="cut each step into micro-batches of this many tokens at full depth, as ouro train does "
        "(it printed its budget in the memory-plan line; 12032 at the e2e shape)",
    )
    parser.add_argument(
        "--prompt-heads",
        action="store_true",
        help="train fixed-budget samples as a body and a prompt head, as ouro train does",
    )
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument(
        "--nondeterministic",
        action="store_true",
        help="CUDA: PyTorch's default kernels instead of the deterministic ones the trainer uses",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--blas",
        choices=["default", "cublas", "cublaslt"],
        default="default",
        help="CUDA: torch.backends.cuda.preferred_blas_library for the run",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="after timing, profile one more step (torch.profiler) and print GPU-busy time per kernel "
        "family and the TOP kernels",
    )
    args = parser.parse_args()
    if args.blas != "default":
        import torch

        torch.backends.cuda.preferred_blas_library(args.blas)

    trainer, setup_s = build_trainer(
        args.shape,
        args.device,
        args.dtype,
        micro_batch_size=args.micro_batch_size,
        pack=not args.no_pack,
        pack_length=args.pack_length,
        recompute=args.recompute,
        distributed_optimizer=args.distributed_optimizer,
        deterministic=not args.nondeterministic,
        max_tokens=args.max_tokens_per_micro_batch,
        prompt_heads=args.prompt_heads,
    )
    result = measure_steps(
        trainer,
        args.shape,
        samples=args.samples,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        depths=args.depths,
        steps=args.steps,
        warmup=args.warmup,
    )
    result["setup_s"] = round(setup_s, 2)
    if trainer.context.rank == 0:
        print(json.dumps(result, indent=2))
    if args.profile:
        profile_step(trainer, args.shape, args.samples, args.prompt_len, args.response_len, args.depths, args.profile)
    trainer.close()


def profile_step(trainer, shape: str, samples: int, prompt_len: int, response_len: int, depths: str, top: int) -> None:
    """One more train step under torch.profiler: wall time against GPU-busy time (their gap is
    host or synchronisation time), busy time per kernel family, and the `top` kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_table import cuda_kernels, print_kernel_table

    batch = make_samples(model_config(shape), samples, prompt_len, response_len, depths, random.Random(99))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = cuda_kernels(prof)
    if trainer.context.rank != 0:
        return
    print(
        f"profiled step: {wall * 1e3:.1f} ms wall (forward+backward {metrics['forward_backward_s'] * 1e3:.1f} ms, "
        f"optimizer {metrics['optimizer_s'] * 1e3:.1f} ms), {len(kernels)} kernels"
    )
    busy = print_kernel_table(kernels, top)
    print(f"  GPU busy {busy / 1e3:.1f} ms = {busy / 1e6 / wall:.1%} of the wall time")
    print("  host: operators by self CPU time (what keeps the GPU waiting when busy is low)")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
    print("\n".join("    " + line for line in table.splitlines()))


if __name__ == "__main__":
    main()
