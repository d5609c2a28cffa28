"""A GPU error (an illegal address, a device-side assert) ends a run in one line naming the
phase and the update, exit 1, with no native abort; the checkpoints saved before it stay, and
`ouro resume` continues from them. The error is made at a test-only fault point
(ouro_cli/testing/faults.py `generate@N=CUDA`): on CPU a simulated one, on a GPU a real
out-of-bounds index."""

from __future__ import annotations

import json

import pytest
import torch

from .test_train_cli import ouro
from .tiny_checkpoint import REWARD, make_checkpoint

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_device_error_is_one_line_and_the_run_resumes(tmp_path, device):
    make_checkpoint(tmp_path)
    run = tmp_path / "run"
    opts = [
        "--model",
        str(tmp_path / "hf"),
        "--data",
        str(tmp_path / "train.jsonl"),
        "--eval-data",
        "",
        "--prompts-per-update",
        "2",
        "--group-size",
        "2",
        "--max-response-len",
        "6",
        "--depths",
        "2",
        "--save-interval",
        "1",
        "--device",
        device,
        "--reward-function",
        REWARD,
    ]
    proc = ouro(
        "train",
        *opts,
        "--updates",
        "3",
        "--run-dir",
        str(run),
        cwd=tmp_path,
        env={"OURO_TEST_FAULT": "generate@2=CUDA"},
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert "CUDA error in the rollout phase (update 1, K=2" in errors[0] and "CUDA_LAUNCH_BLOCKING=1" in errors[0]
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr
    assert [json.loads(x)["update"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0]
    assert (run / "checkpoint" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    proc = ouro("resume", str(run), "--updates", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x)["update"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
