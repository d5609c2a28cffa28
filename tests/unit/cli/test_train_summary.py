"""The table `ouro train` and `ouro resume` print at the end: held-out accuracy per K at the
start and at the end. A resumed run's start evaluation is on disk (evaluations.jsonl, written
by the command that started the run), and the "before" column reads it there."""

from __future__ import annotations

import json

from ouro_cli.cli.common import console
from ouro_cli.cli.train import _print_evaluations
from ouro_cli.rl.run_dir import RunDir


def _row(k: int, accuracy: float, **extra) -> dict:
    return {"k": k, "accuracy": accuracy, "mean_exit_depth": float(k), "mean_tokens": 3.0, **extra}


def test_a_resumed_run_shows_its_start_evaluation_from_disk(tmp_path):
    run = RunDir(tmp_path)
    lines = [_row(2, 0.125, update=0, when="start"), _row(2, 0.375, update=4, when="interval")]
    run.evaluations.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {"evaluations_before": [], "evaluations_after": [_row(2, 0.5)]}  # what a resume returns
    with console.capture() as captured:
        _print_evaluations(summary, run, console)
    row = next(line for line in captured.get().splitlines() if line.strip("│ ").startswith("2 "))
    assert "0.125" in row and "0.500" in row and "0.375" not in row
