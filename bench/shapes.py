"""The memory plan against the measured peaks, over the shapes and modes users run.

    python bench/shapes.py --list                       # the cells
    python bench/shapes.py --cells p100-r512-default    # one cell (1.4B, 2 updates)
    python bench/shapes.py --cells p100-r512-default p100-r512-exact --updates 3 --depths 2 3 4
    python bench/shapes.py --cells p16-r512-default --model tiny --updates 2   # the same path on CPU
    python bench/shapes.py --cells p100-r512-default --eval-samples 8   # and a held-out evaluation's peak

A cell is prompt length x response length x mode (x model). Each runs `ouro train` on
defaults (no memory flags) in a subprocess, on a random Ouro checkpoint with a
49,152-entry tokenizer (bench/e2e.py's), and prints per update the plan's budget beside the
measured peak of each phase (rollout, refill, train, publish, save: `peak_held_*_gib`, the
device memory the process held at once, plus `memory_outside_gib`, the CUDA context), the
update time and PASS where every phase stayed within the budget. Its last line is the cell's
verdict; the exit status is 1 if any cell ran past its budget or failed.

Prompt lengths: `p16`, `p1024` fixed; `p100` drawn per prompt (median 100 tokens, tail to
1,000; bench/workloads.py). Responses: `rN` run to N tokens (the random model rarely stops),
`rNv` stop at varied lengths (bench/workloads.py `with_varied_stops`), so the scheduler admits
new sequences mid-wave. Modes: `default`; `exact` (--exact); `async` (--exit-threshold 0.9
--async-scheduling); `spec` (--speculative-tokens 3, at K = T).

Cells run prompts x samples of 32 x 8 (r512) or 8 x 8 (r4096), or `--prompts` x 8;
`--model 2.6b` builds the 48-layer shape. A run's checkpoint is deleted after its cell; the random
model stays in `--work` for the next call (built whole or not at all).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from e2e import VOCAB, full_size_tokenizer, run_in_own_group  # noqa: E402
from workloads import built_once, prompt_lengths, with_varied_stops, write_prompts  # noqa: E402

GIB = 2**30
PROMPTS = ("p16", "p100", "p1024")
RESPONSES = ("r512", "r512v", "r4096", "r4096v")
MODES = {
    "default": [],
    "exact": ["--exact"],
    "async": ["--exit-threshold", "0.9", "--async-scheduling"],
    "spec": ["--speculative-tokens", "3"],
}
PHASES = ("rollout", "refill", "train", "publish", "save", "evaluation")


def cells() -> list[str]:
    return [f"{p}-{r}-{m}" for p in PROMPTS for r in RESPONSES for m in MODES]


def build_model(directory: Path, model: str) -> None:
    """A random checkpoint (bench/convert.py's streamed writer for 1.4B and 2.6B) with the bench
    tokenizer and room for 8,192 positions."""
    if model == "tiny":
        import torch

        from ouro_cli.checkpoint.hf import write_hf
        from ouro_cli.model import build, tiny_config

        directory.mkdir(parents=True)
        config = tiny_config(vocab_size=VOCAB, max_position_embeddings=8192)
        write_hf(directory, config, build(config, dtype=torch.bfloat16, seed=0).state_dict().items())
    else:
        from convert import write_random_hf

        write_random_hf(directory, seed=0, layers=48 if model == "2.6b" else 24)
    full_size_tokenizer(directory)
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = max(config.get("max_position_embeddings", 0), 8192)
    config_file.write_text(json.dumps(config, indent=2))


def model_checkpoint(work: Path, model: str) -> Path:
    """The random checkpoint of `model` in `work`, built there once for every cell."""
    checkpoint, began = work / f"model-{model}", time.perf_counter()
    if built_once(checkpoint, lambda directory: build_model(directory, model)):
        print(f"== built the random {model} checkpoint in {time.perf_counter() - began:.0f} s", flush=True)
    return checkpoint


def run_cell(
    cell: str,
    model: str,
    work: Path,
    updates: int,
    depths: list[int],
    timeout: float,
    extra: list[str],
    prompts: int | None = None,
    eval_samples: int = 0,
) -> dict:
    prompt, response, mode = cell.split("-")
    tokens = int(response[1:].rstrip("v"))
    prompts, group = (prompts or (32 if tokens <= 512 else 8)), 8
    if model == "tiny":
        prompts, group, tokens = 4, 4, min(tokens, 64)
    if mode == "spec":
        depths = [4]
    checkpoint = model_checkpoint(work, model)
    began = time.perf_counter()  # --timeout covers the cell's own preparation too
    if response.endswith("v"):
        checkpoint = with_varied_stops(checkpoint, VOCAB)
    data = work / f"{prompt}.jsonl"
    write_prompts(data, prompt_lengths(prompt, prompts * max(updates, 1) * 2))
    run = work / f"run-{cell}"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "ouro_cli.cli.app",
        "train",
        "--model",
        str(checkpoint),
        "--data",
        str(data),
        "--eval-data",
        str(data) if eval_samples else "",
        *(
            ["--eval-prompts", str(prompts), "--eval-samples", str(eval_samples), "--eval-depths", str(max(depths))]
            if eval_samples
            else []
        ),
        "--run-dir",
        str(run),
        "--depths",
        *map(str, depths),
        "--updates",
        str(updates),
        "--prompts-per-update",
        str(prompts),
        "--group-size",
        str(group),
        "--max-response-len",
        str(tokens),
        "--save-interval",
        "0",
        "--reward-function",
        "ouro_cli.rl.rewards.boxed_answer",
        *MODES[mode],
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    shape = f"{prompts} x {group} x {tokens}, depths {depths}, {updates} updates"
    if eval_samples:
        shape += f", evaluated at start and end ({prompts} x {eval_samples} at K={max(depths)})"
    print(f"== {cell} ({model}): {shape}", flush=True)
    start = time.perf_counter()
    code, out = run_in_own_group(cmd, env, work, max(1.0, timeout - (start - began)))
    (work / f"run-{cell}.log").write_text(out)
    for line in out.splitlines():
        if line.startswith(("memory:", "error:")):
            print("   ", line, flush=True)
    plan_file = run / "ouro-plan.json"
    budget = json.loads(plan_file.read_text())["sizing"]["budget_bytes"] / GIB if plan_file.exists() else None
    metrics = run / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    marker = run / "COMPLETE"  # a finished run's marker holds its final save's figures
    final_save = json.loads(marker.read_text()).get("final_save") if marker.exists() else None
    shutil.rmtree(run / "checkpoint", ignore_errors=True)
    if code != 0:
        print("\n".join(out.splitlines()[-15:]))
    return {
        "cell": cell,
        "model": model,
        "returncode": code,
        "wall_s": time.perf_counter() - start,
        "budget_gib": budget,
        "updates": records,
        "final_save": final_save,
    }


def verdict(result: dict) -> tuple[bool, list[str]]:
    """(every phase of every update, and the final save, recorded within the plan's budget; one
    line per update and one for the final save). A phase is within it when the most the
    process held from the device at once (PyTorch's segments, cached blocks and CUDA-graph
    pools included, plus the KV cache) plus the memory outside PyTorch (the CUDA context) is at
    most the budget; the line also shows the most its tensors took, and what the graph pools
    held at the update's end. An update's line carries the save before it; the last save,
    after every line, is the run's `final_save` (its COMPLETE marker)."""
    lines, within = [], True
    budget = result["budget_gib"] or 0.0
    for r in result["updates"]:
        outside = r.get("memory_outside_gib") or 0.0
        peaks = {p: (r.get(f"peak_memory_{p}_gib"), r.get(f"peak_held_{p}_gib")) for p in PHASES}
        peaks = {p: v for p, v in peaks.items() if v[0] is not None}
        over = [p for p, (_, held) in peaks.items() if held + outside > budget]
        within = within and not over
        tokens = sum(r.get("rank_response_tokens", [0]))
        lines.append(
            f"  update {r['update']} K={r['k']}: {r['step_s']:.1f} s (rollout {r['rollout_s']:.1f}, train "
            f"{r['train_s']:.1f}); {tokens} response tokens, {r.get('engine_preemptions', 0)} preempted, decode "
            f"batch over time {' '.join(f'{x:.0f}' for x in r.get('engine_decode_batch_tenths') or []) or '-'}; "
            f"peak GiB (held) + {outside:.1f} outside, graph pools {r.get('graph_pools_gib') or 0.0:.1f}, "
            f"budget {budget:.1f}: "
            + ", ".join(f"{p} {n:.1f} ({h:.1f})" for p, (n, h) in peaks.items())
            + (f"  OVER in {', '.join(over)}" if over else "  ok")
        )
    final = result.get("final_save") or {}
    if final.get("peak_held_save_gib") is not None:
        outside = final.get("memory_outside_gib") or 0.0
        over = final["peak_held_save_gib"] + outside > budget
        within = within and not over
        lines.append(
            f"  final save: {final['save_s']:.1f} s; peak GiB (held) + {outside:.1f} outside, budget {budget:.1f}: "
            f"save {final['peak_memory_save_gib']:.1f} ({final['peak_held_save_gib']:.1f})"
            + ("  OVER" if over else "  ok")
        )
    return within, lines


def outcome(result: dict, held: bool, updates: int) -> str:
    """The cell's exit status and seconds, and for a run that did not finish how far it got and
    whether the updates it recorded stayed within the plan (`held`)."""
    said = f"exit {result['returncode']}, {result['wall_s']:.0f} s"
    if result["returncode"] == 0:
        return said
    done = len(result["updates"])
    within = "every phase within the plan" if held else "a phase OVER the plan"
    return f"{said}; {done} of {updates} updates recorded" + (f", {within}" if done else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", default=[], help="cells to run (see --list)")
    parser.add_argument("--list", action="store_true", help="print the cells and exit")
    parser.add_argument("--model", choices=["1.4b", "2.6b", "tiny"], default="1.4b")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--prompts", type=int, help="prompts per update (default 32 at r512, 8 at r4096)")
    parser.add_argument("--depths", type=int, nargs="+", default=[4])
    parser.add_argument(
        "--timeout",
        type=float,
        default=540,
        help="seconds per cell; the random checkpoint is built once before the first, outside every cell's limit",
    )
    parser.add_argument("--work", default="/tmp/ouro-shapes")
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=0,
        help="also evaluate at the start and the end, on the cell's prompts with N samples each at the "
        "deepest K (the start's evaluation peak is in update 0's line)",
    )
    parser.add_argument("--train-args", default="", help="further ouro train flags for every cell")
    args = parser.parse_args()
    if args.list:
        print("\n".join(cells()))
        return
    unknown = [c for c in args.cells if c not in cells()]
    if unknown or not args.cells:
        parser.error(f"unknown or no cells {unknown}; --list shows them")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results, failed = [], False
    model_checkpoint(work, args.model)
    for cell in args.cells:
        result = run_cell(
            cell,
            args.model,
            work,
            args.updates,
            args.depths,
            args.timeout,
            args.train_args.split(),
            args.prompts,
            args.eval_samples,
        )
        held, lines = verdict(result)
        ok = held and result["returncode"] == 0 and bool(result["updates"])
        failed |= not ok
        print("\n".join(lines))
        print(f"{cell} ({args.model}): {'PASS' if ok else 'FAIL'} ({outcome(result, held, args.updates)})", flush=True)
        results.append(result)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
