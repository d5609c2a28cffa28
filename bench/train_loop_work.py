"""The trainer's replay forward + backward with and without gathering each loop's running positions.

    python bench/train_loop_work.py                                  # CPU, a small shape
    python bench/train_loop_work.py --shape 1.4b --device cuda       # Ouro-1.4B shape, bf16, compiled regions
    python bench/train_loop_work.py --sweep                          # one loop at a range of running shares

Random weights at the chosen shape, random prompt/response tokens packed into micro-batch rows
as the trainer packs them (ouro_cli/trainer/batching.py), and two depth schedules:

- `k2`: a K = 2 rollout (every response token ran 2 loops, the prompt T);
- `threshold`: mixed depths as threshold exits give them, each response token's drawn from
  1..T with probabilities 0.4 / 0.3 / 0.2 / 0.1 (more early exits than late ones).

Each schedule runs two ways: `dense`, every loop on every position with the results of
positions past their depth discarded (`GATHER_BELOW = 0`: what the replay ran before), and
`gathered`, the model's default (`ouro_cli/model/ouro.py` GATHER_BELOW): a loop that fewer
positions run than that share gathers them. For each: forward + backward time (the fastest
of --steps after --warmup, the two ways interleaved), layer-token evaluations executed over those the depths require
(real positions × depth × layers) against the limit of 1.05, and the speedup over `dense`.

`--sweep` times the second loop alone (depths 1 or 2, a share f of the positions at 2, less the
time of depth 1 everywhere) both ways and prints gathered / dense per f (ideal: f): where it
crosses 1 is where gathering stops paying.

Not a test: bench/ is outside pytest's testpaths.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LIMIT = 1.05  # executed / required layer-token evaluations the gathered replay must stay under
THRESHOLD_DEPTHS = (0.4, 0.3, 0.2, 0.1)  # P(depth = 1..4) of the `threshold` schedule


def model_config(shape: str):
    from ouro_cli.model import OuroConfig, tiny_config

    if shape == "1.4b":
        return OuroConfig()  # its defaults are Ouro-1.4B: hidden 2048, 24 layers, 16 heads
    return tiny_config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )


def make_samples(c, n: int, prompt_len: int, response_len: int, schedule: str, rng: random.Random):
    from ouro_cli.trainer.batching import Sample

    T = c.num_loops
    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, c.vocab_size) for _ in range(prompt_len)]
        response = [rng.randrange(3, c.vocab_size) for _ in range(response_len)]
        if schedule == "k2":
            exits = [T] + [2] * (response_len - 1)
        else:
            exits = [T] + rng.choices(range(1, T + 1), THRESHOLD_DEPTHS[:T], k=response_len - 1)
        logprobs = [-rng.uniform(0.5, 4.0) for _ in range(response_len)]
        out.append(Sample(prompt, response, exits, logprobs, rng.uniform(-1, 1)))
    return out


def micro_batches(samples, c, max_tokens: int):
    from ouro_cli.trainer.batching import build_micro_batch, loss_weights, plan_micro_batches

    tokens = sum(len(s.response_ids) for s in samples)
    weights = loss_weights(samples, "token_mean", tokens, len(samples))
    plan = plan_micro_batches(samples, max_tokens=max_tokens)
    return [build_micro_batch(samples, weights, c.num_loops, rows=rows) for rows in plan]


def forward_backward(model, mbs, device) -> None:
    import torch

    from ouro_cli.trainer.determinism import deterministic_kernels

    for mb in mbs:
        mb = mb.to(device)
        with deterministic_kernels(device):
            logits = model(
                mb.input_ids,
                mb.depths,
                attention_mask=mb.attention_mask,
                document_ids=mb.document_ids,
                logits_at=(mb.score_rows, mb.score_cols),
            )
            logp = torch.log_softmax(logits.float(), -1).gather(1, mb.targets[:, None]).squeeze(1)
            (-(logp * mb.weights).sum()).backward()


def work(mbs, num_layers: int) -> tuple[int, int]:
    """(executed, required) layer-token evaluations of the forward over `mbs`."""
    from ouro_cli.model.ouro import positions_per_loop

    executed = required = 0
    for mb in mbs:
        executed += num_layers * sum(positions_per_loop(mb.depths, mb.attention_mask))
        real = mb.attention_mask if mb.attention_mask is not None else mb.depths > 0
        required += num_layers * int(mb.depths[real].sum())
    return executed, required


@contextlib.contextmanager
def with_gather_below(share: float):
    """The model's GATHER_BELOW (ouro_cli/model/ouro.py) set to `share` inside the block."""
    from ouro_cli.model import ouro

    before = ouro.GATHER_BELOW
    ouro.GATHER_BELOW = share
    try:
        yield
    finally:
        ouro.GATHER_BELOW = before


def timed(model, runs: dict[str, tuple[list, float]], device, steps: int, warmup: int) -> dict[str, float]:
    """Seconds of one forward + backward over the micro-batches of each of `runs` (name: (micro-batches,
    GATHER_BELOW)), the runs interleaved step by step; the fastest of `steps` after `warmup`
    (a loaded machine only ever adds time)."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + steps):
        for name, (mbs, share) in runs.items():
            with with_gather_below(share):
                model.zero_grad(set_to_none=True)
                sync()
                start = time.perf_counter()
                forward_backward(model, mbs, device)
                sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def compare(model, c, args, device, schedule: str) -> dict:
    rng = random.Random(0)
    samples = make_samples(c, args.samples, args.prompt_len, args.response_len, schedule, rng)
    mbs = micro_batches(samples, c, args.max_tokens)
    layers = c.num_hidden_layers
    result = {"schedule": schedule, "micro_batches": len(mbs)}
    from ouro_cli.model import ouro

    shares = {"dense": 0.0, "gathered": ouro.GATHER_BELOW}
    seconds = timed(model, {path: (mbs, share) for path, share in shares.items()}, device, args.steps, args.warmup)
    for path, share in shares.items():
        with with_gather_below(share):
            executed, required = work(mbs, layers)
        result[path] = {
            "forward_backward_s": round(seconds[path], 4),
            "layer_tokens_executed": executed,
            "layer_tokens_required": required,
            "executed_over_required": round(executed / required, 4),
        }
    dense, gathered = result["dense"], result["gathered"]
    result["speedup"] = round(dense["forward_backward_s"] / gathered["forward_backward_s"], 3)
    result["work_ratio"] = round(dense["layer_tokens_executed"] / gathered["layer_tokens_executed"], 3)
    return result


def sweep(model, c, args, device) -> list[dict]:
    """The second loop alone at running shares f, both ways: the time over that of the first
    loop alone (depth 1 everywhere, `loop1_s`), and their ratio (ideal: f)."""
    import torch

    from ouro_cli.trainer.batching import MicroBatch

    rows, length = args.sweep_rows, args.prompt_len + args.response_len
    n = rows * length
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, c.vocab_size, (rows, length), generator=g)

    def batch(depths):
        return [
            MicroBatch(
                ids,
                depths,
                None,
                None,
                torch.arange(rows).repeat_interleave(length),
                torch.arange(length).repeat(rows),
                ids.flatten(),
                torch.zeros(n),
                torch.zeros(n),
                torch.ones(n),
                torch.full((n,), 1.0 / n),
                rows,
                n,
            )
        ]

    one = batch(torch.ones(rows, length, dtype=torch.long))
    out = []
    for share in args.shares:
        two = batch(1 + (torch.rand(rows, length, generator=g) < share).long())
        seconds = timed(
            model, {"loop1": (one, 0.0), "dense": (two, 0.0), "gathered": (two, 1.01)}, device, args.steps, args.warmup
        )
        row = {"running_share": share, **{name + "_s": round(t, 4) for name, t in seconds.items()}}
        row["gathered_over_dense"] = round(
            (seconds["gathered"] - seconds["loop1"]) / (seconds["dense"] - seconds["loop1"]), 3
        )
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["small", "1.4b"], default="small")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on CUDA")
    parser.add_argument("--samples", type=int, default=None, help="default: 8 on CPU, 8 on CUDA")
    parser.add_argument("--prompt-len", type=int, default=None, help="default: 32 on CPU, 256 on CUDA")
    parser.add_argument("--response-len", type=int, default=None, help="default: 96 on CPU, 768 on CUDA")
    parser.add_argument("--max-tokens", type=int, default=None, help="positions per micro-batch (default: 4 samples)")
    parser.add_argument("--schedules", nargs="+", choices=["k2", "threshold"], default=["k2", "threshold"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sweep", action="store_true", help="time one loop at a range of running shares instead")
    parser.add_argument("--sweep-rows", type=int, default=4)
    parser.add_argument(
        "--shares",
        type=float,
        nargs="+",
        default=[0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98],
        help="--sweep: the running shares timed",
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.samples = args.samples or 8
    args.prompt_len = args.prompt_len or (256 if cuda else 32)
    args.response_len = args.response_len or (768 if cuda else 96)
    args.max_tokens = args.max_tokens or 4 * (args.prompt_len + args.response_len)

    import torch

    from ouro_cli.model import build, ouro

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype, torch.bfloat16 if cuda else torch.float32)
    device = torch.device(args.device)
    c = model_config(args.shape)
    model = build(c, dtype=dtype, device=device, seed=0)
    model.model.early_exit_gate.requires_grad_(False)  # frozen in GRPO
    head = (
        f"{args.shape} shape ({c.hidden_size} hidden, {c.num_hidden_layers} layers, {c.num_attention_heads} heads), "
        f"{str(dtype).removeprefix('torch.')} on {args.device}, GATHER_BELOW {ouro.GATHER_BELOW}"
    )
    if args.sweep:
        rows = sweep(model, c, args, device)
        print(
            f"loop 2 of {args.sweep_rows} x {args.prompt_len + args.response_len} positions (forward + backward, "
            f"minus loop 1 alone), {head}"
        )
        for r in rows:
            dense, gathered = r["dense_s"] - r["loop1_s"], r["gathered_s"] - r["loop1_s"]
            print(
                f"  running share {r['running_share']:.2f}: dense {dense * 1e3:7.1f} ms  gathered "
                f"{gathered * 1e3:7.1f} ms  gathered / dense {r['gathered_over_dense']:.3f} (ideal "
                f"{r['running_share']:.2f})"
            )
        results: object = rows
    else:
        print(
            f"{args.samples} samples x ({args.prompt_len} prompt + {args.response_len} response), micro-batches of "
            f"{args.max_tokens} positions, {head}"
        )
        results = [compare(model, c, args, device, s) for s in args.schedules]
        for r in results:
            d, g = r["dense"], r["gathered"]
            print(
                f"  {r['schedule']:<9} dense    {d['forward_backward_s'] * 1e3:8.1f} ms  executed / required "
                f"{d['executed_over_required']:.3f}"
            )
            print(
                f"  {'':<9} gathered {g['forward_backward_s'] * 1e3:8.1f} ms  executed / required "
                f"{g['executed_over_required']:.3f}  = {g['executed_over_required'] / LIMIT:.3f} of the limit "
                f"{LIMIT}  speedup {r['speedup']:.2f}x (work {r['work_ratio']:.2f}x)"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
