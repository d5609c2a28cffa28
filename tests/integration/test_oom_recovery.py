"""A rollout or a train step that runs out of device memory does not end the run
(rl/recovery.py): the KV limit, or the tokens per micro-batch, is halved and the call or the
step runs again; the decision is recorded in the metrics and the plan, and a fresh-process
resume replays it bit for bit. A device that cannot hold even one sequence ends the run in
one line. The device is simulated (OURO_TEST_KV_LIMIT, OURO_TEST_TRAIN_LIMIT,
ouro_cli/testing/faults.py): a call whose cache would pass 8 blocks fails, and so does a
micro-batch of more than 48 positions (the plan's 64 hold two samples of 32), as a real
allocation would."""

from __future__ import annotations

import json

from .test_train_cli import ouro
from .tiny_checkpoint import REWARD, make_checkpoint


def options(root):
    return [
        "--model",
        str(root / "hf"),
        "--data",
        str(root / "train.jsonl"),
        "--eval-data",
        "",
        "--prompts-per-update",
        "2",
        "--group-size",
        "3",
        "--max-response-len",
        "8",
        "--depths",
        "4",
        "--kv-blocks",
        "16",
        "--block-size",
        "16",
        "--reward-function",
        REWARD,
    ]


def test_out_of_memory_halves_the_cache_and_the_micro_batches_and_replays_on_resume(tmp_path):
    make_checkpoint(tmp_path)
    work = tmp_path / "vr"
    proc = ouro(
        "verify-resume",
        "--updates",
        "2",
        "--resume-at",
        "1",
        "--work-dir",
        str(work),
        *options(tmp_path),
        "--max-tokens-per-micro-batch",
        "64",
        "--mini-batches",
        "2",
        "--json",
        cwd=tmp_path,
        env={"OURO_TEST_KV_LIMIT": "8", "OURO_TEST_TRAIN_LIMIT": "48"},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["identical"]
    decisions = [
        {"update": 0, "rank": 0, "phase": "rollout", "what": "kv_blocks", "kv_blocks": 8},
        {
            "update": 0,
            "rank": 0,
            "phase": "train",
            "step": 0,
            "what": "max_tokens_per_micro_batch",
            "max_tokens_per_micro_batch": 32,
        },
    ]  # the first of the update's two steps; the second keeps it
    for run in ("reference", "resumed"):
        metrics = [json.loads(x) for x in (work / run / "metrics.jsonl").read_text().splitlines()]
        assert [m["memory_decisions"] for m in metrics] == [decisions, []], run  # decided once, then replayed
        assert [m["train_micro_batches"] for m in metrics] == [6, 6], run  # one sample each, in both steps
        assert json.loads((work / run / "ouro-plan.json").read_text())["memory_decisions"] == decisions, run

    proc = ouro(
        "train",
        *options(tmp_path),
        "--updates",
        "1",
        "--run-dir",
        str(tmp_path / "tiny"),
        cwd=tmp_path,
        env={"OURO_TEST_KV_LIMIT": "1"},
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "out of host memory in the rollout phase (update 0" in errors[0]
