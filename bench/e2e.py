"""The whole GRPO job at the shapes users run: `ouro train` as a user would start it, with no
memory flags at all, on a random Ouro-1.4B with a full-size tokenizer.

    python bench/e2e.py                          # cases a and b at the 1.4B shape (GPU, < 10 min)
    python bench/e2e.py --cases a --updates 4    # one case, more updates
    python bench/e2e.py --shape tiny --updates 2 # the same path, tiny model and cases (CPU)

Cases (prompts x samples per prompt x response tokens, `--depths 2 3 4`):
  a  32 x 8 x 512     b  8 x 8 x 2,048     (--shape tiny: 4 x 4 x 64 and 2 x 4 x 256)

It builds an HF directory (random bf16 weights at Ouro-1.4B shapes; a 49,152-entry
word-level tokenizer whose every id decodes; the ChatML ids 0/1/2 as in Ouro) and a
JSONL of arithmetic prompts, runs `python -m ouro_cli.cli.app train` in a subprocess,
and prints per update what `metrics.jsonl` recorded: rollout / train / publish / save /
compile seconds, response tokens per second, sequences in flight (decoded tokens per
decode step), micro-batches, and the peak device memory of each phase, beside the
memory plan the run logged. A random model rarely samples a stop token, so responses run
to the full length: the worst case of each shape. The run's checkpoint is deleted after
each case (19 GB at 1.4B with Adam). `--out FILE` writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

CASES = {"a": (32, 8, 512), "b": (8, 8, 2048)}
TINY_CASES = {"a": (4, 4, 64), "b": (2, 4, 256)}  # --shape tiny: the same path, CPU-sized
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
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "unk_token": "<unk>", "model_max_length": 65536}, indent=2) + "\n")


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


def write_data(path: Path, rows: int = 256) -> None:
    g = random.Random(0)
    with open(path, "w") as f:
        for i in range(rows):
            a, b = g.randint(0, 99), g.randint(0, 99)
            f.write(json.dumps({"prompt": f"What is {a}+{b}?", "label": a + b, "metadata": {"problem_id": i}}) + "\n")


def run_case(name: str, shape: str, work: Path, model: Path, data: Path, updates: int, timeout: float) -> dict:
    prompts, group, response = (CASES if shape == "1.4b" else TINY_CASES)[name]
    run = work / f"run-{name}"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "ouro_cli.cli.app", "train", "--model", str(model), "--data", str(data),
           "--eval-data", "", "--run-dir", str(run), "--depths", "2", "3", "4", "--updates", str(updates),
           "--prompts-per-update", str(prompts), "--group-size", str(group), "--max-response-len", str(response),
           "--save-interval", "0"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    print(f"== case {name}: {prompts} prompts x {group} samples x {response} tokens, {updates} updates", flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - start
    (work / f"run-{name}.log").write_text(done.stdout)  # everything the run printed
    lines = done.stdout.splitlines()
    for line in lines:
        if line.startswith(("memory:", "error:", "update ", "engine:")) or "warning" in line:
            print("   ", line, flush=True)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
    if done.returncode != 0:
        print("\n".join(lines[-30:]))
    shutil.rmtree(run / "checkpoint", ignore_errors=True)  # 19 GB at 1.4B: the next case needs the disk
    return {"case": name, "shape": [prompts, group, response], "returncode": done.returncode, "wall_s": wall,
            "updates": records}


def gib(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(result: dict) -> str:
    head = ("upd K | rollout s   tok/s  in-flight | train s compile mb x tokens   rc | publish s  save s | "
            "peak GiB roll/train/pub/save")
    out = [head, "-" * len(head)]
    for r in result["updates"]:
        tokens = sum(r["rank_response_tokens"])
        steps = r.get("engine_decode_steps") or 0
        in_flight = r.get("engine_decode_tokens", 0) / steps if steps else 0.0
        out.append(
            f"{r['update']:>3} {r['k']} | {r['rollout_s']:>9.1f} {tokens / r['rollout_s']:>7.0f} {in_flight:>10.1f} | "
            f"{r['train_s']:>7.1f} {r['compile_s']:>7.1f} {r['train_micro_batches']:>2} x {r['train_micro_batch_tokens_max']:>6}"
            f" {'on' if r.get('train_layer_tokens_recomputed') else 'off':>4} | {r['publish_s']:>9.2f} {r['save_s']:>7.1f} | "
            f"{gib(r.get('peak_memory_rollout_gib'))}/{gib(r.get('peak_memory_train_gib'))}/"
            f"{gib(r.get('peak_memory_publish_gib'))}/{gib(r.get('peak_memory_save_gib'))}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["1.4b", "tiny"], default="1.4b")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--updates", type=int, default=3, help="updates per case (one per K of --depths 2 3 4)")
    parser.add_argument("--work", default="/tmp/ouro-e2e", help="scratch folder (model, data, runs)")
    parser.add_argument("--timeout", type=float, default=560, help="seconds per case")
    parser.add_argument("--out", help="write every figure here as JSON")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, data = work / f"model-{args.shape}", work / "train.jsonl"
    if not (model / "config.json").exists():
        start = time.perf_counter()
        shutil.rmtree(model, ignore_errors=True)
        build_model(model, args.shape)
        print(f"built {model} in {time.perf_counter() - start:.1f} s", flush=True)
    write_data(data)
    results = [run_case(c, args.shape, work, model, data, args.updates, args.timeout) for c in args.cases]
    for r in results:
        print(f"\n== case {r['case']} ({' x '.join(map(str, r['shape']))}): exit {r['returncode']}, "
              f"{r['wall_s']:.0f} s in all")
        if r["updates"]:
            print(table(r))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    sys.exit(max(r["returncode"] for r in results))


if __name__ == "__main__":
    main()
