"""`torchrun --nproc-per-node 2 -m ouro_cli.cli.app train` on CPU (gloo) against one rank
with the same global batch, and `ouro compare` on the pair.

Two ranks sample exactly what one rank samples (seeds follow the global batch position,
records are written in global order), every metrics line shows both ranks, the plan
they agreed on and their bit-identical parameters, and the final weights match one
rank's to fp32 reduction order (gradients summed over ranks instead of within one
batch: ~1e-7). `ouro compare` passes the pair at 1e-5 and fails a tampered copy and a
tolerance below the measured difference. Both jobs sample by self-speculation in exact
mode (the pairs rl/combinations.py names this test for): every rank's engine and trainer
agree exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .test_train_cli import REPO, ouro
from .tiny_checkpoint import REWARD, make_checkpoint

pytestmark = pytest.mark.slow


def _flags(root: Path) -> list[str]:
    return [
        "--model",
        str(root / "hf"),
        "--data",
        str(root / "train.jsonl"),
        "--eval-data",
        str(root / "eval.jsonl"),
        "--prompts-per-update",
        "4",
        "--group-size",
        "3",
        "--max-response-len",
        "6",
        "--eval-prompts",
        "2",
        "--eval-depths",
        "4",
        "--max-num-seqs",
        "4",
        "--reward-function",
        REWARD,
        "--depths",
        "4",
        "--speculative-tokens",
        "2",
        "--exact",
        "--updates",
        "2",
        "--save-interval",
        "0",
    ]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _compare(*args: str) -> subprocess.CompletedProcess:
    return ouro("compare", *args, cwd=REPO)


def test_two_ranks_match_one_rank_and_ouro_compare_judges_the_pair(tmp_path):
    make_checkpoint(tmp_path)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ouro_cli.cli.app",
            "train",
            *_flags(tmp_path),
            "--run-dir",
            str(tmp_path / "two"),
            "--json",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-4000:]
    assert json.loads(two.stdout)["ok"]  # one document: rank 0 speaks for the job
    one = ouro("train", *_flags(tmp_path), "--run-dir", str(tmp_path / "one"), cwd=tmp_path)
    assert one.returncode == 0, one.stderr

    metrics = _lines(tmp_path / "two" / "metrics.jsonl")
    assert [m["update"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["ranks"] == 2 and m["plan_agreed_ranks"] == 2 and m["params_identical_across_ranks"] is True
        assert len(m["rank_param_sha256"]) == 2 and len(set(m["rank_param_sha256"])) == 1
        assert m["rank_samples"] == [6, 6] and m["rank_device"] == ["cpu", "cpu"]
        assert sum(m["rank_response_tokens"]) == sum(m["response_lengths"])
    single = _lines(tmp_path / "one" / "metrics.jsonl")
    assert all(m["ranks"] == 1 and len(m["rank_param_sha256"]) == 1 for m in single)
    for m in metrics + single:
        assert m["logprob_mismatch_max"] == 0.0 and m["engine_spec_draft_tokens"] > 0, m["update"]
    for update in range(2):
        name = f"update_{update:06d}.jsonl"
        a, b = _lines(tmp_path / "one" / "rollouts" / name), _lines(tmp_path / "two" / "rollouts" / name)
        assert [(r["problem_id"], r["seed"]) for r in a] == [(r["problem_id"], r["seed"]) for r in b]
        assert [r["response_ids"] for r in a] == [r["response_ids"] for r in b]

    # fp32 Adam at lr 1e-4: an element with a noise-level gradient may step differently by up to ~lr
    proc = _compare(str(tmp_path / "one"), str(tmp_path / "two"), "--weights-atol", "1e-4", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WITHIN TOLERANCE" in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["identical_fraction"] == 1.0 and all(doc["checks"].values())
    assert 0 < doc["weights_max_abs_diff"] < 1e-4  # summation order through Adam, not a bug
    assert doc["training_update"]["rel_diff"] < 1e-3  # of what one rank learned, two ranks learned alike (5e-4 seen)
    assert doc["throughput"]["b"]["ranks"] == 2

    assert _compare(str(tmp_path / "one"), str(tmp_path / "two"), "--atol", "1e-12").returncode == 1
    shutil.copytree(tmp_path / "two", tmp_path / "tampered")
    path = tmp_path / "tampered" / "rollouts" / "update_000001.jsonl"
    records = _lines(path)
    records[5]["response_ids"][0] += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = _compare(str(tmp_path / "one"), str(tmp_path / "tampered"))
    assert proc.returncode == 1 and "rollout_tokens=FAIL" in proc.stdout, proc.stdout + proc.stderr  # the report
    last = proc.stderr.strip().splitlines()[-1]  # the one error line names the checks that failed
    assert last.startswith("error: ") and f"tampered is beyond tolerance of {tmp_path / 'one'}: " in last
    assert "rollout_tokens" in last
    missing = _compare(str(tmp_path / "one"), str(tmp_path / "missing"))
    assert missing.returncode == 2 and "missing is not a directory" in missing.stderr
