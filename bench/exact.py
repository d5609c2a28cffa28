"""What exact mode costs and what it buys: decode tokens/s, the training step, and the
engine-trainer agreement, default against `--exact` (docs/exact.md).

    python bench/exact.py                                  # CPU, a small shape: the three sections
    python bench/exact.py --device cuda --shape 1.4b       # the H200: random Ouro-1.4B weights, bf16
    python bench/exact.py --sections agree --batches 1 8 32 128
    python bench/exact.py --device cuda --shape 1.4b --sections train --train-samples 32 --prompt 18 --new-tokens 512 \\
        --profile 25

The last profiles the train step at bench/e2e.py's row shape (32 rows of 18 + 512 tokens) and
prints each mode's costliest operators: where exact mode's train phase loses its time.

Times are medians of --repeats, wall time on CUDA and the process's CPU time on CPU (one
thread: a figure other processes on the cores do not inflate).

- decode: `LLM.generate` of --batch prompts (--prompt tokens, --new-tokens each) at K = T,
  tokens/s in each mode and their ratio.
- train: `Trainer.train_step` on random samples (--train-samples x (--prompt + --new-tokens)
  tokens, random exit depths), median seconds per step in each mode and their ratio.
- agree: for each batch size of --batches, rollouts at K = 2, 3, 4 and at K = T with threshold
  exits (τ = 0.7), replayed by the trainer on the weights the engine was given (the loop's
  publication path): max and mean |Δ logprob| in each mode. In exact mode the max must be 0.

Random weights (std 0.02; the CPU shapes keep a gate that gives mixed exit depths), random
prompts. Prints one table and, with --json, writes every figure. Not a test: bench/ is
outside pytest's testpaths.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ouro_cli.model import OuroConfig, OuroForCausalLM, from_state_dict, tiny_config  # noqa: E402
from ouro_cli.settings import ExecutionSettings  # noqa: E402

ALL_MODES = {"default": ExecutionSettings(), "exact": ExecutionSettings(exact=True)}
MODES = dict(ALL_MODES)  # --modes narrows it
SECTIONS = ("decode", "train", "agree")


def config(shape: str) -> OuroConfig:
    if shape == "1.4b":
        return OuroConfig()  # hidden 2048, 24 layers, 16 heads, vocab 49152
    if shape == "small":
        return tiny_config(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
        )
    return tiny_config()


def random_model(cfg: OuroConfig, dtype: torch.dtype, device: str) -> OuroForCausalLM:
    """Random weights made on the device; a gate whose exits vary from token to token."""
    with torch.device(device):
        model = OuroForCausalLM(cfg)
        g = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, 0.02, generator=g)
            gate = model.model.early_exit_gate
            gate.weight.normal_(0.0, 3.0 / cfg.hidden_size**0.5, generator=g)
            gate.bias.fill_(-1.0)
    return model.to(dtype=dtype)


def clock(device: str):
    """Wall time on CUDA (synchronised); on CPU the process's CPU time, which other processes
    sharing the cores do not inflate (the CPU runs use one thread)."""
    return time.perf_counter if device == "cuda" else time.process_time


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def engine(model: OuroForCausalLM, rows: int, length: int, execution: ExecutionSettings):
    from ouro_cli.engine import LLM

    per_seq = -(-(length + 1) // 16)
    return LLM(
        model,
        max_num_seqs=rows,
        kv_blocks=rows * per_seq + 8,
        block_size=16,
        max_prefill_tokens=max(8192, rows * length),
        execution=execution,
    )


def section_decode(a, cfg, dtype) -> dict:
    from ouro_cli.engine import SamplingParams

    out = {}
    for mode, execution in MODES.items():
        model = random_model(cfg, dtype, a.device)
        llm = engine(model, a.batch, a.prompt + a.new_tokens, execution)
        try:
            params = SamplingParams(max_tokens=a.new_tokens, temperature=1.0, seed=0, ignore_eos=True)
            batch = prompts(a.batch, a.prompt, cfg.vocab_size)
            llm.generate(batch, params)  # warm-up: captures, compiles
            times = []
            for _ in range(a.repeats):
                sync(a.device)
                start = clock(a.device)()
                llm.generate(batch, params)
                sync(a.device)
                times.append(clock(a.device)() - start)
        finally:
            llm.close()
        out[mode] = a.batch * a.new_tokens / statistics.median(times)
        progress(f"decode {mode}: {out[mode]:.0f} tok/s")
    return {"decode_tok_s": out, "ratio": _ratio(out)}


def trainer_for(model: OuroForCausalLM, device: str, dtype_name: str, execution: ExecutionSettings):
    """A trainer of `model`; on CUDA with micro-batches of 4,096 tokens and recompute, so that
    the agreement's 128 rollouts fit at the 1.4B shape."""
    from ouro_cli.trainer import Trainer, TrainerConfig

    sized = dict(max_tokens_per_micro_batch=4096, recompute="on") if device == "cuda" else {}
    return Trainer(model, TrainerConfig(device=device, params_dtype=dtype_name, lr=1e-6, **sized), execution=execution)


def random_samples(cfg, n: int, prompt_len: int, response_len: int, rng: random.Random):
    from ouro_cli.trainer import Sample

    t = cfg.num_loops
    return [
        Sample(
            [rng.randrange(3, cfg.vocab_size) for _ in range(prompt_len)],
            [rng.randrange(3, cfg.vocab_size) for _ in range(response_len)],
            [t] + [rng.randint(1, t) for _ in range(response_len - 1)],
            [-rng.uniform(0.5, 4.0) for _ in range(response_len)],
            rng.uniform(-1, 1),
        )
        for _ in range(n)
    ]


def section_train(a, cfg, dtype) -> dict:
    out, profiles = {}, {}
    for mode, execution in MODES.items():
        trainer = trainer_for(random_model(cfg, dtype, a.device), a.device, a.dtype, execution)
        rng = random.Random(0)
        try:
            times = []
            for step in range(a.repeats + 1):
                batch = random_samples(cfg, a.train_samples, a.prompt, a.new_tokens, rng)
                sync(a.device)
                start = clock(a.device)()
                trainer.train_step(batch)
                sync(a.device)
                if step:  # the first step compiles and allocates
                    times.append(clock(a.device)() - start)
            if a.profile:
                profiles[mode] = profile_step(
                    trainer, random_samples(cfg, a.train_samples, a.prompt, a.new_tokens, rng), a.device, a.profile
                )
        finally:
            trainer.close()
        out[mode] = statistics.median(times)
        progress(f"train {mode}: {out[mode]:.3f} s per step")
        if a.profile:
            progress(
                f"train {mode}: top {a.profile} ops of one step by own {profiles[mode]['by']} time\n"
                + profiles[mode]["table"]
            )
    return {"train_step_s": out, "ratio": _ratio(out), **({"profiles": profiles} if a.profile else {})}


def profile_step(trainer, batch, device: str, top: int) -> dict:
    """One more train step under torch.profiler: its `top` operators by own device time (CUDA) or
    own CPU time, as torch.profiler's table prints them (where exact mode's cost sits)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        trainer.train_step(batch)
        sync(device)
    by = "cuda" if device == "cuda" else "cpu"
    table = prof.key_averages().table(sort_by=f"self_{by}_time_total", row_limit=top, max_name_column_width=60)
    return {"by": by, "table": table}


def progress(line: str) -> None:
    """One figure as soon as it is measured (a run stopped at a time limit keeps what it printed)."""
    print(line, flush=True)


def _ratio(out: dict) -> float | None:
    return out["exact"] / out["default"] if {"exact", "default"} <= set(out) else None


def section_agree(a, cfg, dtype) -> dict:
    from ouro_cli.engine import SamplingParams
    from ouro_cli.rl.publish import publish
    from ouro_cli.trainer import Sample

    t = cfg.num_loops
    policies = [(k, 1.0) for k in (2, 3, 4) if k <= t] + [(t, 0.7)]
    results: dict = {}
    for mode, execution in MODES.items():
        trainer = trainer_for(random_model(cfg, dtype, a.device), a.device, a.dtype, execution)
        try:
            weights = {name: x.detach().clone() for name, x in trainer.named_weights_for_publication()}
            engine_model = from_state_dict(cfg, weights, device=a.device)
            del weights
            for batch in a.batches:
                llm = engine(engine_model, batch, a.prompt + a.agree_new_tokens, execution)
                try:
                    publish(llm, trainer.named_weights_for_publication(), version=1)  # the loop's path
                    rows = [policies[i % len(policies)] for i in range(batch)]
                    params = [
                        SamplingParams(
                            max_tokens=a.agree_new_tokens,
                            temperature=1.0,
                            seed=100 + i,
                            logprobs=0,
                            ignore_eos=True,
                            max_loops=k,
                            exit_threshold=tau,
                        )
                        for i, (k, tau) in enumerate(rows)
                    ]
                    batch_prompts = prompts(batch, a.prompt, cfg.vocab_size, seed=batch)
                    outs = llm.generate(batch_prompts, params)
                finally:
                    llm.close()
                samples = [
                    Sample(p, list(o.output_token_ids), list(o.exit_depths), [float(x) for x in o.log_probs], 0.0)
                    for p, o in zip(batch_prompts, outs, strict=True)
                ]
                metrics = trainer.forward_backward(samples)
                depths = [d for o in outs for d in o.exit_depths[1:]]
                results.setdefault(mode, {})[batch] = {
                    "max": metrics["logprob_mismatch_max"],
                    "mean": metrics["logprob_mismatch_mean"],
                    "mean_exit_depth": sum(depths) / max(1, len(depths)),
                    "tokens": metrics["response_tokens"],
                    "by_depth": metrics.get("logprob_mismatch_max_by_depth"),
                }
                progress(
                    f"agree {mode} batch {batch}: max |d| {metrics['logprob_mismatch_max']:.3g}, "
                    f"mean {metrics['logprob_mismatch_mean']:.3g}"
                )
            del engine_model
        finally:
            trainer.close()
    return results


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=["tiny", "small", "1.4b"], help="default: 1.4b on CUDA, small on CPU")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--batch", type=int, help="decode batch (default 64 on CUDA, 8 on CPU)")
    ap.add_argument("--prompt", type=int, help="prompt tokens (default 128 on CUDA, 32 on CPU)")
    ap.add_argument("--new-tokens", type=int, help="decoded / response tokens (default 128 on CUDA, 32 on CPU)")
    ap.add_argument("--train-samples", type=int, help="samples per train step (default 8 on CUDA, 4 on CPU)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per figure (median)")
    ap.add_argument(
        "--batches", type=int, nargs="+", help="agree: rollouts per run (default 1 8 32 128 on CUDA, 1 4 16 on CPU)"
    )
    ap.add_argument("--agree-new-tokens", type=int, help="agree: tokens per rollout (default 64 on CUDA, 16 on CPU)")
    ap.add_argument("--modes", default="default,exact", help="comma-separated subset of default,exact")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="train: after the timed steps, profile one more and print its N costliest operators",
    )
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    a.shape = a.shape or ("1.4b" if cuda else "small")
    a.batch = a.batch or (64 if cuda else 8)
    a.prompt = a.prompt or (128 if cuda else 32)
    a.new_tokens = a.new_tokens or (128 if cuda else 32)
    a.train_samples = a.train_samples or (8 if cuda else 4)
    a.batches = a.batches or ([1, 8, 32, 128] if cuda else [1, 4, 16])
    a.agree_new_tokens = a.agree_new_tokens or (64 if cuda else 16)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.manual_seed(0)
    if a.device == "cpu":
        torch.set_num_threads(1)
    cfg = config(a.shape)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    sections = a.sections.split(",")
    MODES.clear()
    MODES.update({m: ALL_MODES[m] for m in a.modes.split(",")})
    report: dict = {
        "device": a.device,
        "shape": a.shape,
        "dtype": a.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if "decode" in sections:
        report["decode"] = section_decode(a, cfg, dtype)
        d = report["decode"]
        figures = ", ".join(f"{m} {v:.1f} tok/s" for m, v in d["decode_tok_s"].items())
        ratio = f", exact/default x{d['ratio']:.3f}" if d["ratio"] else ""
        print(
            f"decode  {a.shape} {a.dtype} batch {a.batch}, {a.prompt}+{a.new_tokens} tokens, K={cfg.num_loops}: "
            f"{figures}{ratio}",
            flush=True,
        )
    if "train" in sections:
        report["train"] = section_train(a, cfg, dtype)
        t = report["train"]
        figures = ", ".join(f"{m} {v:.3f} s/step" for m, v in t["train_step_s"].items())
        ratio = f", exact/default x{t['ratio']:.2f} time" if t["ratio"] else ""
        print(
            f"train   {a.shape} {a.dtype} {a.train_samples} x ({a.prompt}+{a.new_tokens}) tokens: {figures}{ratio}",
            flush=True,
        )
    if "agree" in sections:
        report["agree"] = section_agree(a, cfg, dtype)
        for mode, by_batch in report["agree"].items():
            for batch, r in by_batch.items():
                print(
                    f"agree   {mode:7s} {a.shape} {a.dtype} batch {batch:4d} (K 2/3/4 + τ 0.7, mean depth "
                    f"{r['mean_exit_depth']:.2f}, {r['tokens']} tokens): max |Δ logprob| {r['max']:.3g}, "
                    f"mean {r['mean']:.3g}",
                    flush=True,
                )
        if "exact" in report["agree"]:
            worst = max(r["max"] for r in report["agree"]["exact"].values())
            print(
                f"agree   exact mode: max |Δ logprob| over every batch = {worst!r} "
                f"({'exact' if worst == 0.0 else 'NOT exact'})",
                flush=True,
            )
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
