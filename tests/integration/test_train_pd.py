"""`ouro train --prefill-devices 0 --decode-devices 1` end to end through the real CLI.

On CPU each device index is a worker process; the KV moves over the shared-memory
fallback (chosen with OURO_PD_TRANSPORT=shm; NIXL is covered by tests/unit/engine/test_pd.py). The same job with the
local engine
must produce identical rollouts: the PD engine is only a placement, never a change
of what is sampled. The job trains with threshold exits and every option of the loss
and the data on, the optimizer state offloaded (the pairs rl/combinations.py names this
test for): the second update's rollouts, sampled on the weights the first trained and
published, agree too.
"""

from __future__ import annotations

import json
from pathlib import Path

from .test_train_cli import ouro, small
from .tiny_checkpoint import make_checkpoint


def _rollouts(run: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((run / "rollouts").glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_train_with_pd_workers_matches_the_local_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("OURO_PD_TRANSPORT", "shm")  # the fallback, present everywhere
    make_checkpoint(tmp_path)
    common = [
        "--depths",
        "2",
        "4",
        "--updates",
        "2",
        *small(tmp_path),
        "--max-num-seqs",
        "1",
        "--eval-prompts",
        "2",
        "--exit-threshold",
        "0.7",
        "--mini-batches",
        "2",
        "--epochs",
        "2",
        "--is-correction",
        "tis",
        "--clip-ratio-c",
        "3",
        "--loop-weighting",
        "progressive",
        "--advantage",
        "rloo",
        "--overlong",
        "soft",
        "--filter-groups",
        "--offload-optimizer",
        "on",
        "--json",
    ]
    pd = ouro(
        "train",
        "--run-dir",
        str(tmp_path / "pd"),
        "--prefill-devices",
        "0",
        "--decode-devices",
        "1",
        *common,
        cwd=tmp_path,
    )
    assert pd.returncode == 0, pd.stderr
    summary = json.loads(pd.stdout)
    assert summary["ok"] and summary["updates"] == 2 and summary["last_weight_version"] == 3
    metrics = [json.loads(x) for x in (tmp_path / "pd" / "metrics.jsonl").read_text().splitlines()]
    assert [m["weight_version"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["kv_transport"] == "shm"
        assert m["engine_kv_transfers"] == 3 * m["prompts_drawn"] and m["engine_kv_transfer_bytes"] > 0  # group 3
        assert m["logprob_mismatch_max"] < 1e-5
    local = ouro("train", "--run-dir", str(tmp_path / "local"), *common, cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    pd_rollouts, local_rollouts = _rollouts(tmp_path / "pd"), _rollouts(tmp_path / "local")
    assert len(pd_rollouts) == 3 * sum(m["prompts_drawn"] for m in metrics) >= 12
    for a, b in zip(pd_rollouts, local_rollouts, strict=True):
        for key in ("response_ids", "exit_depths", "logprobs", "weight_version"):
            assert a[key] == b[key], key


def test_pd_flags_must_come_together(tmp_path):
    proc = ouro("train", "--prefill-devices", "0", "--run-dir", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2 and "--decode-devices" in proc.stderr and "Traceback" not in proc.stderr
