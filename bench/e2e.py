"""The whole GRPO job at the shapes users run: `ouro train` as a user would start it, with no
memory flags at all, on a random Ouro-1.4B with a full-size tokenizer.

    python bench/e2e.py                          # cases a and b at the 1.4B shape (GPU, < 10 min)
    python bench/e2e.py --cases a --updates 6    # one case, a steady-state update at each K
    python bench/e2e.py --cases b --depths 4 --updates 2   # one K only
    python bench/e2e.py --shape tiny --updates 2 # the same path, tiny model and cases (CPU)
    python bench/e2e.py --nproc 2 --dist-optimizer   # also on 2 data-parallel GPUs: the scaling
    python bench/e2e.py --cases a --train-args "--async-save --save-interval 1"  # any ouro train flags
    python bench/e2e.py --cases a --depths 2 --updates 3 --train-args --exact   # exact mode's whole update
    python bench/e2e.py --cases a --depths 2 --updates 2 --host-profile 1   # where a rollout's host time goes
    python bench/e2e.py --cases a --depths 2 --updates 2 --train-profile 1  # where a train step's time goes

Cases (prompts x samples per prompt x response tokens, by default at `--depths 2 3 4`):
  a  32 x 8 x 512     b  8 x 8 x 2,048     v  32 x 8 x 512, responses that stop at varied lengths
  (--shape tiny: 4 x 4 x 64, 2 x 4 x 256 and 4 x 4 x 64)
Prompts (`--prompts`): p100, drawn with a median of 100 tokens and a tail to 1,000, as math
RL's are (bench/workloads.py); `--prompts arith` gives the short sums (about 18 tokens) of the
earlier anchors in docs/performance.md, whose commands name it.

It builds an HF directory (random bf16 weights at Ouro-1.4B shapes; a 49,152-entry
word-level tokenizer whose every id decodes; the ChatML ids 0/1/2 as in Ouro) and a
JSONL of prompts, runs `python -m ouro_cli.cli.app train` in a subprocess,
and prints per update what `metrics.jsonl` recorded: rollout (and of it the prefill) /
train / publish / save / compile seconds, CUDA-graph capture seconds, the host's waits for
sampled tokens (a rollout much longer than its waits and captures was bound by the host's
per-step work, not the GPU), the device time of the decode steps' forwards and of their
sampling (CUDA events, so the graph's share of a step shows beside the sampling's),
optimizer-step seconds (with the host copies of `--offload-optimizer`), the train phase's
allocator retries (a cache flush and a device sync each: a phase at the edge of its memory),
response tokens per second, sequences in flight (decoded tokens per decode step), the decode steps
(about the longest response when every sequence decodes at once; more after preemptions or a second
wave), micro-batches, and the peak device memory of each phase,
beside the memory plan the run logged. A second table puts each phase beside its limit
(bench/e2e_limits.py: the rollout's bytes roofline, the trainer's model FLOPs at 780
TFLOP/s, the publication's copy) and sums them into the update's, then gives the steady
state per K: the updates after each K's first, which compiles and captures CUDA graphs.
A random model rarely samples a stop token, so responses in cases a and b run to the full
length: the worst case of each shape; case v's stop at varied lengths, so sequences finish at
different times and the scheduler admits new ones mid-wave. The run's checkpoint is deleted after
each case (19 GB at 1.4B with Adam); the random model stays in `--work` for the next call
(built whole or not at all). `--out FILE` writes every figure as JSON.

`--nproc N` runs each case again under `torchrun --nproc-per-node N` with the same global
batch (each rank samples and trains its share) and prints the strong scaling: update time,
rollout and train tokens/s per GPU, the efficiency N-rank throughput / (N x one-rank
throughput), and whether the replicas' parameters stayed bit-identical (the run's own
check after every update); `--dist-optimizer` adds a run with the optimizer state sharded
over the ranks (the table's peak memory is rank 0's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import e2e_limits  # noqa: E402  (bench/e2e_limits.py: each phase at the hardware's limit)
from workloads import built_once, prompt_lengths, with_varied_stops, write_prompts  # noqa: E402

from ouro_cli.model.config import OuroConfig  # noqa: E402
from ouro_cli.rl.options import DEFAULT_ENGINE  # noqa: E402

CASES = {"a": (32, 8, 512), "b": (8, 8, 2048), "v": (32, 8, 512)}
TINY_CASES = {"a": (4, 4, 64), "b": (2, 4, 256), "v": (4, 4, 64)}  # --shape tiny: the same path, CPU-sized
VARIED = ("v",)  # cases whose responses stop at varied lengths (workloads.with_varied_stops)
VOCAB = 49152


def full_size_tokenizer(directory: Path, vocab_size: int = VOCAB) -> None:
    """tokenizer.json + tokenizer_config.json: Ouro's special ids, the characters and words the
    prompts use, then filler words up to `vocab_size`; decoding concatenates tokens, so every
    id decodes to text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = list("0123456789+-*/=()?.,:;!{}[]<>|\\_'\"#%&^~@$`") + [" ", "\n", "\t"]
    words = ["user", "assistant", "What", "is", "the", "answer", "think", "boxed"]
    vocab = {tok: i for i, tok in enumerate(special + chars + words)}
    for i in range(len(vocab), vocab_size):
        vocab[f" w{i}"] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[A-Za-z]+|[0-9]|\s|[^A-Za-z0-9\s]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<unk>",
                "model_max_length": 65536,
            },
            indent=2,
        )
        + "\n"
    )


def build_model(directory: Path, shape: str) -> None:
    if shape == "1.4b":
        from convert import (
            write_random_hf,  # bench/convert.py: streamed random bf16 weights at 1.4B
        )

        write_random_hf(directory, seed=0)
    else:
        import torch

        from ouro_cli.checkpoint.hf import write_hf
        from ouro_cli.model import build, tiny_config

        directory.mkdir(parents=True)
        config = tiny_config(vocab_size=VOCAB, max_position_embeddings=4096)
        model = build(config, dtype=torch.bfloat16, seed=0)
        write_hf(directory, config, model.state_dict().items())
    full_size_tokenizer(directory)


def write_data(path: Path, prompts: str, rows: int = 256) -> None:
    """`rows` training prompts: `arith` short sums (about 18 tokens chat-rendered), else
    workloads.py's prompt lengths (`p100`: median 100 tokens, tail to 1,000)."""
    if prompts != "arith":
        write_prompts(path, prompt_lengths(prompts, rows))
        return
    g = random.Random(0)
    with open(path, "w") as f:
        for i in range(rows):
            a, b = g.randint(0, 99), g.randint(0, 99)
            f.write(json.dumps({"prompt": f"What is {a}+{b}?", "label": a + b, "metadata": {"problem_id": i}}) + "\n")


def run_in_own_group(cmd: list[str], env: dict, cwd: Path, timeout: float) -> tuple[int, str]:
    """Run `cmd` in a process group of its own -> (exit status, everything it printed). Past
    `timeout` seconds, and if this script is stopped itself (SIGTERM from an outer `timeout`,
    Ctrl-C), the whole group is killed: a run left behind holds its GPU memory, and the next
    case then finds too little free (a device call lost a case that way, docs/log/performance.md). The updates a
    stopped run finished still count."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
        return proc.returncode, stdout
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, _ = proc.communicate()
        return 124, (stdout or "") + f"\nerror: the case ran past --timeout {timeout:.0f} s and was stopped\n"
    finally:
        if proc.poll() is None:  # this script is being stopped: take the run down with it
            _kill_group(proc)
            proc.wait()


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group may be gone already
        os.killpg(proc.pid, signal.SIGKILL)


def run_case(
    name: str,
    shape: str,
    work: Path,
    model: Path,
    data: Path,
    updates: int,
    timeout: float,
    nproc: int = 1,
    extra: tuple[str, ...] = (),
    depths: tuple[int, ...] = (2, 3, 4),
    host_profile: int | None = None,
    train_profile: int | None = None,
) -> dict:
    prompts, group, response = (CASES if shape == "1.4b" else TINY_CASES)[name]
    label = f"{name}-{nproc}gpu" + ("-" + "-".join(a.lstrip("-") for a in extra) if extra else "")
    run = work / f"run-{label}"
    shutil.rmtree(run, ignore_errors=True)
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        if nproc > 1
        else [sys.executable]
    )
    stats = work / f"host-profile-{label}.pstats"
    train_table = work / f"train-profile-{label}.txt"
    entry = ["-m", "ouro_cli.cli.app"]
    if nproc == 1 and host_profile is not None:
        entry = [str(REPO / "bench" / "train_host_profile.py"), str(host_profile), str(stats)]
    elif nproc == 1 and train_profile is not None:
        entry = [str(REPO / "bench" / "train_step_profile.py"), str(train_profile), str(train_table)]
    stats.unlink(missing_ok=True)
    train_table.unlink(missing_ok=True)
    cmd = [
        *launch,
        *entry,
        "train",
        "--model",
        str(model),
        "--data",
        str(data),
        "--eval-data",
        "",
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
        str(response),
        "--save-interval",
        "0",
        "--reward-function",
        "ouro_cli.rl.rewards.boxed_answer",
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    print(
        f"== case {label}: {prompts} prompts x {group} samples x {response} tokens, {updates} updates"
        + (f" on {nproc} ranks" if nproc > 1 else ""),
        flush=True,
    )
    start = time.perf_counter()
    returncode, stdout = run_in_own_group(cmd, env, work, timeout)
    wall = time.perf_counter() - start
    (work / f"run-{label}.log").write_text(stdout)  # everything the run printed
    lines = stdout.splitlines()
    for line in lines:
        if line.startswith(("memory:", "error:", "update ", "engine:")) or "warning" in line:
            print("   ", line, flush=True)
    records = (
        [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        if (run / "metrics.jsonl").exists()
        else []
    )
    if returncode != 0:
        print("\n".join(lines[-30:]))
    plan = json.loads((run / "ouro-plan.json").read_text())["options"] if (run / "ouro-plan.json").exists() else {}
    shutil.rmtree(run / "checkpoint", ignore_errors=True)  # 19 GB at 1.4B: the next case needs the disk
    if stats.exists():
        print_host_profile(stats, records[host_profile] if host_profile < len(records) else {})
    if train_table.exists():
        record = records[train_profile] if train_profile < len(records) else {}
        print(
            f"    profile of update {train_profile}'s train step (K = {record.get('k', '?')}, "
            f"{record.get('train_micro_batches', '?')} micro-batches):"
        )
        print("\n".join("      " + line for line in train_table.read_text().splitlines()))
    return {
        "case": label,
        "shape": [prompts, group, response],
        "nproc": nproc,
        "returncode": returncode,
        "wall_s": wall,
        "updates": records,
        # what the rollout's roofline counts (e2e_limits.py): the built-in local engine shares a
        # group's prompt blocks; the PD engine and other factories hold a copy per sample
        "shared_prompts": bool(plan.get("share_prompts", True))
        and not plan.get("prefill_devices")
        and plan.get("engine", DEFAULT_ENGINE) == DEFAULT_ENGINE,
        "kv_fp8": plan.get("kv_cache_dtype") == "fp8",
    }


def print_host_profile(stats: Path, record: dict, top: int = 14) -> None:
    """The cProfile of one rollout (bench/train_host_profile.py), by own and by cumulative time,
    with the host's time per decode step beside the update's figures for that rollout."""
    import pstats

    from train_host_profile import print_top

    steps = record.get("engine_decode_steps") or 0
    profile = pstats.Stats(str(stats))
    total = profile.total_tt
    rollout = record.get("rollout_s")
    print(
        f"    host profile of update {record.get('update', '?')}'s rollout: {total:.2f} s under cProfile"
        + (f" of its {rollout:.2f} s rollout phase (the rest: building and checking the samples)" if rollout else "")
        + (
            f", {total / steps * 1e3:.2f} ms of it per decode step ({steps} steps; waits for tokens "
            f"{record.get('engine_token_wait_us', 0) / steps / 1e3:.2f} ms per step)"
            if steps
            else ""
        )
        + f"; {stats}"
    )
    print_top(str(stats), top, indent="      ")


def scaling(one: dict, many: dict) -> str:
    """Strong scaling of the same global batch over N ranks: update time (steady state: the
    updates after the first), rollout and train tokens/s per GPU, efficiency = N-rank
    throughput / (N x one-rank throughput), and whether the replicas stayed identical."""

    def steady(result: dict) -> list[dict]:
        return result["updates"][1:] or result["updates"]

    def mean(values: list[float]) -> float:
        return sum(values) / max(len(values), 1)

    n = many["nproc"]
    t1, tn = mean([r["step_s"] for r in steady(one)]), mean([r["step_s"] for r in steady(many)])
    roll = mean([sum(r["rank_response_tokens"]) / max(r["rank_rollout_s"]) / n for r in steady(many)])
    train = mean([r["train_tokens"] / max(r["rank_train_s"]) / n for r in steady(many)])
    identical = all(r.get("params_identical_across_ranks") for r in many["updates"])
    return (
        f"{many['case']}: update {tn:.1f} s on {n} ranks against {t1:.1f} s on one; per GPU rollout "
        f"{roll:.0f} tok/s, train {train:.0f} tok/s; scaling efficiency {t1 / (n * tn):.2f} (goal 0.9); "
        f"replicas identical after every update: {identical}"
    )


def disaggregation(local: dict, pd: dict) -> str:
    """The prefill/decode engine's rollout against the local engine's at the same batch, and the
    KV bytes the prefill worker moved to the decode worker per update."""

    def rate(result: dict) -> float:
        rows = result["updates"][1:] or result["updates"]
        return sum(sum(r["rank_response_tokens"]) / r["rollout_s"] for r in rows) / len(rows)

    moved = [r.get("engine_kv_transfer_bytes", 0) / 2**30 for r in pd["updates"]]
    return (
        f"{pd['case']}: rollout {rate(pd):.0f} tok/s against {rate(local):.0f} local "
        f"(x{rate(pd) / rate(local):.2f}); KV moved per update: {', '.join(f'{g:.2f}' for g in moved)} GiB"
    )


def gib(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(result: dict) -> str:
    head = (
        "upd K | rollout s prefill capture  wait s   fwd s   smp s   tok/s  in-flight  steps"
        " | train s compile  opt s mb x tokens passes  rc retry"
        " | publish s  save s"
        " | peak GiB roll/train/pub/save"
    )
    out = [head, "-" * len(head)]
    for r in result["updates"]:
        tokens = sum(r["rank_response_tokens"])
        steps = r.get("engine_decode_steps") or 0
        in_flight = r.get("engine_decode_tokens", 0) / steps if steps else 0.0
        out.append(
            f"{r['update']:>3} {r['k']} | {r['rollout_s']:>9.1f} {r.get('engine_prefill_us', 0) / 1e6:>7.1f} "
            f"{r.get('engine_graph_capture_ms', 0) / 1e3:>7.1f} "
            f"{r.get('engine_token_wait_us', 0) / 1e6:>7.1f} {r.get('engine_decode_forward_gpu_us', 0) / 1e6:>7.1f} "
            f"{r.get('engine_decode_sample_gpu_us', 0) / 1e6:>7.1f} {tokens / r['rollout_s']:>7.0f} "
            f"{in_flight:>10.1f} {steps:>6} | "
            f"{r['train_s']:>7.1f} {r['compile_s']:>7.1f} {r.get('train_optimizer_s', 0.0):>6.2f} "
            f"{r['train_micro_batches']:>2} x {r['train_micro_batch_tokens_max']:>6}"
            f" {r.get('train_loop_passes', 0):>3}/{r.get('train_gathered_loop_passes', 0):<2}"
            f" {'on' if r.get('train_layer_tokens_recomputed') else 'off':>4} {r.get('train_alloc_retries') or 0:>5}"
            f" | {r['publish_s']:>9.2f} {r['save_s']:>7.1f} | "
            f"{gib(r.get('peak_memory_rollout_gib'))}/{gib(r.get('peak_memory_train_gib'))}/"
            f"{gib(r.get('peak_memory_publish_gib'))}/{gib(r.get('peak_memory_save_gib'))}"
        )
    return "\n".join(out)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that a running case is killed
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["1.4b", "tiny"], default="1.4b")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument(
        "--prompts",
        default="p100",
        help="prompt lengths: p100 (drawn, median 100 tokens, tail to 1,000), pN (N tokens each), or arith "
        "(short sums, about 18 tokens)",
    )
    parser.add_argument("--updates", type=int, default=3, help="updates per case (the K of --depths in turn)")
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 3, 4], help="the K the updates cycle through")
    parser.add_argument("--work", default="/tmp/ouro-e2e", help="scratch folder (model, data, runs)")
    parser.add_argument("--timeout", type=float, default=560, help="seconds per case")
    parser.add_argument("--out", help="write every figure here as JSON")
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="also run each case on N data-parallel ranks (torchrun) and print the scaling",
    )
    parser.add_argument(
        "--dist-optimizer",
        action="store_true",
        help="with --nproc: a further N-rank run with the distributed optimizer",
    )
    parser.add_argument(
        "--host-profile",
        type=int,
        metavar="UPDATE",
        help="cProfile the rollout of update UPDATE (0-based) in the one-rank run and print its "
        "top functions (bench/train_host_profile.py)",
    )
    parser.add_argument(
        "--train-profile",
        type=int,
        metavar="UPDATE",
        help="torch.profiler over the train step of update UPDATE (0-based) in the one-rank run: "
        "GPU busy against wall, kernel families, top kernels and operators "
        "(bench/train_step_profile.py; not with --host-profile)",
    )
    parser.add_argument(
        "--pd",
        action="store_true",
        help="also run each case with prefill on GPU 0 and decode on GPU 1 (--prefill-devices 0 "
        "--decode-devices 1) and compare its rollout with the local engine's",
    )
    parser.add_argument(
        "--train-args",
        default="",
        help="further ouro train flags for every run, e.g. '--async-save --offload-optimizer on'",
    )
    argv = sys.argv[1:]
    # `--train-args --exact`: argparse reads a lone value that starts with "--" as an option
    # (one with a space in it, "--a --b", it takes as a value), so the value is joined to its flag
    for i, arg in enumerate(argv[:-1]):
        if arg == "--train-args":
            argv[i : i + 2] = [f"--train-args={argv[i + 1]}"]
            break
    args = parser.parse_args(argv)
    if args.host_profile is not None and args.train_profile is not None:
        parser.error("--host-profile and --train-profile wrap the same run: give one")
    base, depths = tuple(shlex.split(args.train_args)), tuple(args.depths)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, data = work / f"model-{args.shape}", work / "train.jsonl"
    start = time.perf_counter()
    if built_once(model, lambda directory: build_model(directory, args.shape)):
        print(f"built {model} in {time.perf_counter() - start:.1f} s", flush=True)
    write_data(data, args.prompts)
    config = OuroConfig.from_file(model / "config.json")
    results, pairs = [], []
    for c in args.cases:
        case_model = with_varied_stops(model, VOCAB) if c in VARIED else model
        one = run_case(
            c,
            args.shape,
            work,
            case_model,
            data,
            args.updates,
            args.timeout,
            1,
            base,
            depths,
            args.host_profile,
            args.train_profile,
        )
        results.append(one)
        if args.nproc > 1:
            for extra in [()] + ([("--dist-optimizer",)] if args.dist_optimizer else []):
                many = run_case(
                    c, args.shape, work, case_model, data, args.updates, args.timeout, args.nproc, base + extra, depths
                )
                results.append(many)
                pairs.append((one, many))
        if args.pd:
            pd = run_case(
                c,
                args.shape,
                work,
                case_model,
                data,
                args.updates,
                args.timeout,
                1,
                base + ("--prefill-devices", "0", "--decode-devices", "1"),
                depths,
            )
            results.append(pd)
            if one["updates"] and pd["updates"]:
                print(disaggregation(one, pd))
    for r in results:
        print(
            f"\n== case {r['case']} ({' x '.join(map(str, r['shape']))}): exit {r['returncode']}, "
            f"{r['wall_s']:.0f} s in all"
        )
        if r["updates"]:
            print(table(r))
            print(e2e_limits.table(r, config))
    for one, many in pairs:
        if one["updates"] and many["updates"]:
            print(scaling(one, many))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    sys.exit(max(r["returncode"] for r in results))


if __name__ == "__main__":
    main()
