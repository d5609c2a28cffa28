"""The workloads the benches run: prompts shaped like math RL's, and a model whose responses stop
at varied lengths (bench/e2e.py, bench/shapes.py).

Prompt lengths: `p100` draws each prompt's length from a log-normal with median 100 tokens and a
tail to 1,000 (the shape of MATH / DeepScaleR / AIME prompts); `pN` fixes them at N tokens. A
prompt of n tokens is n - 16 random digits (one token each in the benches' tokenizer) and a
short question, once chat-rendered.

Varied stops: a random model's next token is near-uniform over the vocabulary, so it rarely
samples the one stop id and responses run to the limit (each shape's worst case). Naming one
vocabulary entry in STOP_SHARE as a stop id makes responses stop after about STOP_SHARE tokens
on average, from a few to the limit, so sequences finish at different times and the scheduler
admits new ones mid-wave, as in real RL.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path

STOP_SHARE = 256  # one vocabulary entry in this many is a stop id (`with_varied_stops`)
MIN_PROMPT, MAX_PROMPT = 20, 1000


def prompt_lengths(kind: str, n: int, seed: int = 0) -> list[int]:
    """`n` prompt lengths in tokens: `p100` drawn (median 100, tail to 1,000), `pN` N each."""
    if kind != "p100":
        return [int(kind[1:])] * n
    g = random.Random(seed)
    return [int(min(MAX_PROMPT, max(MIN_PROMPT, g.lognormvariate(math.log(100), 0.7)))) for _ in range(n)]


def write_prompts(path: Path, lengths: list[int]) -> None:
    """One JSONL row per length: a prompt of about that many tokens, its label and problem id."""
    g = random.Random(1)
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            digits = "".join(g.choice("0123456789") for _ in range(max(1, n - 16)))
            row = {"prompt": f"{digits} What is 1+{i % 9}?", "label": 1 + i % 9, "metadata": {"problem_id": i}}
            f.write(json.dumps(row) + "\n")


def built_once(directory: Path, build: Callable[[Path], None]) -> bool:
    """Make the random checkpoint `directory` unless it is there: `build` writes a `.partial`
    sibling that is renamed to `directory` when it returns, so a folder under the final name is
    whole (a build cut off leaves the partial one, built again next time) -> whether it built."""
    if (directory / "config.json").exists():
        return False
    partial = directory.with_name(directory.name + ".partial")
    for stale in (partial, directory):
        shutil.rmtree(stale, ignore_errors=True)
    build(partial)
    partial.rename(directory)
    return True


def with_varied_stops(model: Path, vocab_size: int) -> Path:
    """A copy of the HF directory `model` (its other files linked, not copied) whose config names
    one vocabulary entry in STOP_SHARE as a stop id -> its path, beside `model`."""
    variant = model.with_name(model.name + "-stops")
    variant.mkdir(exist_ok=True)
    for item in model.iterdir():
        target = variant / item.name
        if item.name != "config.json" and not target.exists():
            target.symlink_to(item.resolve())
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = list(range(100, vocab_size, STOP_SHARE))
    (variant / "config.json").write_text(json.dumps(config, indent=2))
    return variant
