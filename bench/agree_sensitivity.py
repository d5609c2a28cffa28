"""How far one rounding difference travels: the engine-vs-replay |Δ logprob| next to the
|Δ logprob| that nudging a few embedding values by one ulp causes, on the same rollouts.

    python bench/agree_sensitivity.py                         # CPU: Ouro-1.4B shape, random bf16 (~2 min)
    python bench/agree_sensitivity.py --device cuda           # on a GPU
    python bench/agree_sensitivity.py --shape tiny --dtype fp32

The engine samples rollouts (K = 2, 3, 4 and a τ = 0.7 exit, as bench/gpu_table.py's agree
section); the model the trainer wraps replays them with their exit depths (docs/model.md §3).
Rows: the engine against the replay (the agreement the issue targets), the replay against
itself (0: it is deterministic), and the replay against a replay whose embedding output has
a random fraction of its values moved one ulp up (`--fractions`). When a nudge far smaller
than the differences between the engine's and the trainer's kernels already moves the
logprobs as much as those kernels do, no single kernel explains the gap: only computing
every operation with the same bits on both sides closes it. Not part of the test run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import decode as decode_bench  # noqa: E402

from ouro_cli.model import OuroConfig, build, tiny_config  # noqa: E402

TARGET = {"bf16": 1e-2, "fp32": 1e-5}  # the engine-vs-trainer targets
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def rollouts(model, config, args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids [n, P+N], per-position depths [n, P+N], engine logprobs [n, N])."""
    t = config.total_ut_steps
    policies = decode_bench.agree_policies(t)
    rows = [policies[i % len(policies)] for i in range(args.rollouts)]
    prompts = decode_bench.make_prompts(len(rows), args.prompt, config.vocab_size)
    llm = decode_bench.rollout_engine(model, len(rows), args.prompt, args.new_tokens)
    try:
        outs = llm.generate(prompts, decode_bench.rollout_params(rows, args.new_tokens))
    finally:
        llm.close()
    ids = torch.tensor([p + list(o.output_token_ids) for p, o in zip(prompts, outs, strict=True)])
    depths = torch.tensor([[t] * args.prompt + list(o.exit_depths[1:]) + [1] for o in outs])  # the last scores nothing
    logprobs = torch.tensor([[float(x) for x in o.log_probs] for o in outs])
    return ids, depths, logprobs


def replay(
    model, ids: torch.Tensor, depths: torch.Tensor, prompt: int, nudge: torch.Tensor | None = None
) -> torch.Tensor:
    """The response tokens' log-probabilities [n, N] from the full-sequence forward; with
    `nudge` (0/1 per embedding value) those values move one ulp up (their bits + 1)."""
    device = next(model.parameters()).device
    embed = model.embed
    if nudge is not None:

        def nudged(x):
            h = embed(x)
            bits = h.view(BITS[h.dtype])
            return (bits + nudge.to(device, bits.dtype)).view(h.dtype)

        model.embed = nudged
    try:
        with torch.no_grad():
            logits = model(ids[:, :-1].to(device), depths[:, :-1].to(device))
    finally:
        model.embed = embed
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None].to(device))[..., 0]
    return logprobs[:, prompt - 1 :].cpu()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=["tiny", "1.4b"], default="1.4b")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[1e-2, 1e-4],
        help="shares of the embedding output's values nudged one ulp up, one row each",
    )
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU")

    config = OuroConfig() if args.shape == "1.4b" else tiny_config()
    model = build(config, dtype=DTYPES[args.dtype], device=args.device, seed=0)
    start = time.perf_counter()
    ids, depths, engine = rollouts(model, config, args)
    base = replay(model, ids, depths, args.prompt)
    target = TARGET[args.dtype]
    print(
        f"{args.shape} {args.dtype} on {args.device}: {len(ids)} rollouts of {args.prompt}+{args.new_tokens}, "
        f"mean decode depth {depths[:, args.prompt : -1].float().mean():.2f}"
    )
    print(f"{'what':<60} {'mean |Δ|':>10} {'max |Δ|':>10} {'x target':>9}")

    def row(what: str, other: torch.Tensor) -> None:
        diff = (base - other).abs()
        mean = diff.mean().item()
        ratio = f"{target / mean:.3g}" if mean > 0 else "-"
        print(f"{what:<60} {mean:>10.4g} {diff.max().item():>10.4g} {ratio:>9}")

    row("engine vs replay", engine)
    row("replay vs replay (repeat)", replay(model, ids, depths, args.prompt))
    g = torch.Generator().manual_seed(1)
    values = (ids.shape[0], ids.shape[1] - 1, config.hidden_size)
    for fraction in args.fractions:
        nudge = (torch.rand(values, generator=g) < fraction).to(torch.int32)
        row(
            f"replay vs replay, {int(nudge.sum())} of {nudge.numel():,} embedding values 1 ulp up",
            replay(model, ids, depths, args.prompt, nudge),
        )
    print(f"x target: the target ({target:g}) over the mean; {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
