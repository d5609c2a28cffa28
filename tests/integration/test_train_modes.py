"""`ouro train` in the engine's execution modes, end to end through the real CLI.

Self-speculation (`--speculative-tokens 3 --depths 4`): every rollout token is verified
at full depth, the trainer's replay agrees with the engine's logprobs, the metrics
report the acceptance rate, and evaluations run at K = 4 only. Asynchronous scheduling
(`--async-scheduling` with threshold exits) trains on delayed-exit rollouts that the
trainer replays exactly. Both train with every option of the loss and the data on
(`TRAINED`: several steps per update, the IS correction, the dual clip, loop weighting,
an advantage, group filtering, overlong handling) and the optimizer state offloaded, the
pairs rl/combinations.py names these tests for. Incompatible combinations fail as usage
errors (exit 2) naming the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from .test_train_cli import T, ouro, small
from .tiny_checkpoint import make_checkpoint

TRAINED = [
    "--mini-batches",
    "2",
    "--epochs",
    "2",
    "--is-correction",
    "tis",
    "--clip-ratio-c",
    "3",
    "--loop-weighting",
    "exit-pdf",
    "--advantage",
    "dr-grpo",
    "--overlong",
    "soft",
    "--filter-groups",
    "--offload-optimizer",
    "on",
]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_speculative_training_runs_at_full_depth(tmp_path):
    make_checkpoint(tmp_path)
    run = tmp_path / "run"
    proc = ouro(
        "train",
        "--speculative-tokens",
        "3",
        "--depths",
        str(T),
        "--updates",
        "2",
        "--run-dir",
        str(run),
        *small(tmp_path),
        *TRAINED,
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    metrics = _lines(run / "metrics.jsonl")
    assert [m["k"] for m in metrics] == [T, T]
    for m in metrics:
        assert set(m["exit_depth_histogram"]) == {str(T)}
        assert m["logprob_mismatch_max"] < 1e-5  # engine target logprobs vs trainer replay, fp32 CPU
        assert m["engine_spec_draft_tokens"] > 0
        assert 0.0 <= m["engine_spec_acceptance_rate"] <= 1.0
        assert m["engine_spec_verify_rows"] >= m["engine_spec_draft_tokens"]
        assert m["train_optimizer_steps"] + m["train_empty_mini_batches"] == 4
    for update in range(2):
        records = _lines(run / "rollouts" / f"update_{update:06d}.jsonl")
        assert all(r["exit_depths"] == [T] * len(r["response_ids"]) for r in records)
    evals = _lines(run / "evaluations.jsonl")
    assert {(e["when"], e["k"]) for e in evals} == {("start", T), ("end", T)}
    plan = json.loads((run / "ouro-plan.json").read_text())
    assert plan["contract"]["speculative_tokens"] == 3 and plan["options"]["eval_depths"] == [T]


def test_async_scheduling_trains_on_replayable_delayed_exits(tmp_path):
    make_checkpoint(tmp_path)
    run = tmp_path / "run"
    proc = ouro(
        "train",
        "--async-scheduling",
        "--exit-threshold",
        "0.5",
        "--depths",
        "3",
        str(T),
        "--updates",
        "2",
        "--eval-depths",
        str(T),
        "--run-dir",
        str(run),
        *small(tmp_path),
        *TRAINED,
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    metrics = _lines(run / "metrics.jsonl")
    assert [m["k"] for m in metrics] == [3, T]
    assert all(m["logprob_mismatch_max"] < 1e-5 for m in metrics)
    assert all(m["train_optimizer_steps"] + m["train_empty_mini_batches"] == 4 for m in metrics)
    depths = {
        d for u in range(2) for r in _lines(run / "rollouts" / f"update_{u:06d}.jsonl") for d in r["exit_depths"][1:]
    }
    # tokens exit early (below K), and one loop late: a signal at loop 1 exits after loop 2, never after 1
    assert depths and min(depths) == 2 and max(depths) < T, depths


def test_speculation_with_a_depth_schedule_is_a_usage_error(tmp_path):
    for extra, words in (
        (["--depths", "2", "3", "4"], "--depths T alone"),
        (["--depths", "4", "--async-scheduling"], "synchronous scheduling"),
        (["--depths", "4", "--eval-depths", "2", "4"], "--eval-depths"),
        (["--depths", "3"], "--depths 4"),
    ):  # one K, but not T (found once the model is read)
        proc = ouro("train", "--speculative-tokens", "3", *extra, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
