"""`--logger tensorboard --logger wandb`: the trackers get metrics.jsonl's figures per update.

TensorBoard's event files are read back with TensorBoard's own reader; Weights & Biases
runs offline (WANDB_MODE=offline, no network) and leaves its run files in RUN/logs/. The
run evaluates two samples per held-out prompt, so its evaluations carry avg@2 and pass@k
and the trackers get pass@k beside the accuracy.
"""

from __future__ import annotations

import json

import pytest

from .test_train_cli import ouro


def test_tensorboard_and_wandb_get_the_metrics(tmp_path):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    proc = ouro(
        "train",
        "--updates",
        "2",
        "--prompts-per-update",
        "4",
        "--group-size",
        "2",
        "--eval-prompts",
        "8",
        "--eval-samples",
        "2",
        "--logger",
        "tensorboard",
        "--logger",
        "wandb",
        "--run-dir",
        str(run),
        cwd=tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    events = EventAccumulator(str(run / "logs" / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    reward = events.Scalars("reward_mean")
    assert [e.step for e in reward] == [0, 1]
    assert [e.value for e in reward] == pytest.approx([r["reward_mean"] for r in rows])
    assert [e.step for e in events.Scalars("reward_mean/K=2")] == [0]
    assert {"train_grad_norm", "rollout_s", "logprob_mismatch_mean", "compile_s"} <= set(tags["scalars"])
    accuracy = events.Scalars("eval/accuracy/K=4")
    assert [e.step for e in accuracy] == [0, 2]  # before the first update and after the last
    evaluations = [json.loads(line) for line in (run / "evaluations.jsonl").read_text().splitlines()]
    at_4 = [e for e in evaluations if e["k"] == 4]
    assert all(e["samples"] == 2 and e["accuracy"] == e["avg@2"] for e in evaluations)
    assert all(e["pass@1"] == pytest.approx(e["accuracy"], abs=1e-12) for e in evaluations)
    assert all(e["pass@1"] <= e["pass@2"] for e in evaluations)
    assert [e.value for e in accuracy] == pytest.approx([e["accuracy"] for e in at_4])
    assert [e.value for e in events.Scalars("eval/pass@2/K=4")] == pytest.approx([e["pass@2"] for e in at_4])
    histogram = events.Histograms("exit_depth")
    assert [h.step for h in histogram] == [0, 1]
    assert histogram[0].histogram_value.num == sum(rows[0]["exit_depth_histogram"].values())

    offline = list((run / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0

    bad = ouro("train", "--logger", "csv", "--run-dir", str(tmp_path / "bad"), cwd=tmp_path)
    assert bad.returncode == 2 and "--logger must be one of tensorboard, wandb, got 'csv'" in bad.stderr
