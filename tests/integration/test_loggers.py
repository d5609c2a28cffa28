"""`--logger tensorboard --logger wandb`: the trackers get metrics.jsonl's figures per update,
under grouped tags, and `ouro resume` continues the same W&B run.

The run trains one update and a resume trains the second. TensorBoard's event files are read
back with TensorBoard's own reader; Weights & Biases runs offline (WANDB_MODE=offline, no
network) and leaves one offline run per command in RUN/logs/wandb/, read back here record by
record. The run evaluates two samples per held-out prompt, so its evaluations carry avg@2 and
pass@k and the trackers get pass@k beside the accuracy.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ouro_cli.rl.tracker_tags import GROUPS

from .test_train_cli import ouro

WANDB = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B `.wandb` file: a 7-byte header, then LevelDB-style log
    blocks of 32 KiB whose chunks (7-byte header: crc, length, type) make up the records."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunks, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


@pytest.mark.slow
def test_trackers_get_grouped_metrics_and_a_resume_continues_the_wandb_run(tmp_path):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    proc = ouro(
        *("train", "--updates", "1", "--prompts-per-update", "4", "--group-size", "2"),
        *("--eval-prompts", "4", "--eval-samples", "2", "--eval-depths", "4"),
        *("--logger", "tensorboard", "--logger", "wandb", "--wandb-project", "grpo", "--wandb-tag", "tiny"),
        *("--run-dir", str(run)),
        cwd=tmp_path,
        env=WANDB,
    )
    assert proc.returncode == 0, proc.stderr
    proc = ouro("resume", str(run), "--updates", "2", cwd=tmp_path, env=WANDB)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the start evaluation's phase figures ride on update 0's line; the resumed update had none
    assert rows[0]["evaluation_when"] == "start" and rows[0]["evaluation_s"] > 0
    assert rows[0]["peak_held_evaluation_gib"] is None  # a CUDA figure
    assert not [key for key in rows[1] if "evaluation" in key]

    events = EventAccumulator(str(run / "logs" / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {t.split("/")[0] for t in tags} <= set(GROUPS)
    reward = events.Scalars("reward/mean")
    assert [e.step for e in reward] == [0, 1]
    assert [e.value for e in reward] == pytest.approx([r["reward_mean"] for r in rows])
    assert [e.step for e in events.Scalars("reward/mean/K=2")] == [0]
    assert {"train/grad_norm", "timing/rollout_s", "train/logprob_mismatch_mean", "rollout/truncations"} <= set(tags)
    # structural zeros on CPU without speculation, compilation or --filter-groups; no duplicates
    zeros = ("rollout/engine_spec_", "rollout/engine_decode_steps_graphed", "timing/compile_s", "rollout/refill")
    assert not [t for t in tags if t.startswith(zeros)]
    assert "train/train_logprob_mismatch_mean" not in tags and "rollout/update" not in tags
    accuracy = events.Scalars("eval/accuracy/K=4")
    assert [e.step for e in accuracy] == [0, 2]  # start and end (the first command's end, at 1, purged)
    evaluations = [json.loads(line) for line in (run / "evaluations.jsonl").read_text().splitlines()]
    assert all(e["samples"] == 2 and e["accuracy"] == e["avg@2"] for e in evaluations)
    assert all(e["pass@1"] == pytest.approx(e["accuracy"], abs=1e-12) for e in evaluations)
    assert all(e["pass@1"] <= e["pass@2"] for e in evaluations)
    shown = [e for e in evaluations if e["update"] in (0, 2)]
    assert [e.value for e in accuracy] == pytest.approx([e["accuracy"] for e in shown])
    assert [e.value for e in events.Scalars("eval/pass@2/K=4")] == pytest.approx([e["pass@2"] for e in shown])
    histogram = events.Histograms("rollout/exit_depth")
    assert [h.step for h in histogram] == [0, 1]
    assert histogram[0].histogram_value.num == sum(rows[0]["exit_depth_histogram"].values())

    run_id = (run / "logs" / "wandb_id").read_text().strip()
    offline = sorted((run / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [p.name for p in offline] == [f"run-{run_id}.wandb"] * 2  # one per command, one W&B run
    logged = []
    for path in offline:
        records = wandb_records(path)
        (info,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (info.run_id, info.project, info.display_name, list(info.tags)) == (run_id, "grpo", "run", ["tiny"])
        for r in records:
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                if "reward/mean" in items:
                    logged.append((path, items["update"], items["reward/mean"]))
    assert [(p, u) for p, u, _ in logged] == [(offline[0], 0), (offline[1], 1)]
    assert [v for *_, v in logged] == pytest.approx([r["reward_mean"] for r in rows])

    bad = ouro("train", "--logger", "csv", "--run-dir", str(tmp_path / "bad"), cwd=tmp_path)
    assert bad.returncode == 2 and "--logger must be one of tensorboard, wandb, got 'csv'" in bad.stderr
