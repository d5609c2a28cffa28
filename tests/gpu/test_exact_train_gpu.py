"""`ouro train --exact` on CUDA at a real job's features: every update's engine-vs-trainer
mismatch is exactly 0.0 (docs/exact.md), as the CPU test (tests/integration/test_exact_train.py)
shows for the tiny model. Here the model has Ouro-1.4B's width and two layers and the prompts
are drawn as math RL's are (median 100 tokens, tail to 1,000), so the GPU runs what a real
exact job runs: CUDA graphs for decode and prefill, bucketed and eager prefills, a group's
shared prompt blocks, the cascade pass where a group shares three tiles or more, and each
variant of the KV cache (bf16, fp8), each with shared prompts and with every sample's own copy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_train_cli import ouro

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

VARIANTS = {  # shared prompts and the cascade, or each sample's own copy (no cascade); bf16 or fp8 KV
    "bf16": [],
    "bf16-copied": ["--no-share-prompts"],
    "fp8": ["--kv-cache-dtype", "fp8"],
    "fp8-copied": ["--kv-cache-dtype", "fp8", "--no-share-prompts"],
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from convert import write_random_hf
    from e2e import full_size_tokenizer
    from workloads import prompt_lengths, write_prompts

    root = tmp_path_factory.mktemp("exact-gpu")
    write_random_hf(root / "model", seed=0, layers=2)
    full_size_tokenizer(root / "model")
    write_prompts(root / "data.jsonl", prompt_lengths("p100", 64))
    return root


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exact_train_on_cuda_has_no_mismatch(inputs, tmp_path, variant):
    run = tmp_path / "run"
    proc = ouro(
        "train",
        "--model",
        str(inputs / "model"),
        "--data",
        str(inputs / "data.jsonl"),
        "--eval-data",
        "",
        "--run-dir",
        str(run),
        "--exact",
        "--updates",
        "2",
        "--depths",
        "2",
        "4",
        "--prompts-per-update",
        "16",
        "--group-size",
        "8",
        "--max-response-len",
        "64",
        "--save-interval",
        "0",
        "--reward-function",
        "ouro_cli.rl.rewards.boxed_answer",
        *VARIANTS[variant],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    seen = [(m["k"], m["logprob_mismatch_max"], m["logprob_mismatch_mean"]) for m in metrics]
    print(variant, seen)
    assert all(m["logprob_mismatch_max"] == 0.0 for m in metrics), seen
