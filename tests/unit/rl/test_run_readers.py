"""Every reader of a run (`ouro status`, `ouro plot`) reads its records as `resume` does
(rl/metrics.py `read_jsonl`): a last line cut short by a killed writer is left out and
said, any other damage is one line naming the file; a damaged trainer_state.json is named."""

from __future__ import annotations

import json

import pytest

from ouro_cli.artifacts import mark_complete
from ouro_cli.checkpoint import layout
from ouro_cli.errors import UserError
from ouro_cli.rl.plots import plot_run
from ouro_cli.rl.run_dir import RunDir
from ouro_cli.rl.status import run_status


@pytest.fixture
def run(tmp_path):
    """A run of 4 updates stopped after update 1, killed mid-line in both of its logs, with a
    checkpoint at 2 whose trainer_state.json is damaged."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.plan.write_text(json.dumps({"plan_version": 1, "contract": {}, "options": {"updates": 4}, "next_update": 2}))
    metrics = [{"update": u, "k": 2 + u % 2, "reward_mean": 0.25 * u, "response_lengths": [3, 4]} for u in range(2)]
    run.metrics.write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"update": 2, "k"')
    run.evaluations.write_text(json.dumps({"update": 0, "k": 2, "when": "start", "accuracy": 0.5}) + '\n{"upd')
    it = run.checkpoint / "iter_0000002"
    it.mkdir(parents=True)
    (it / "trainer_state.json").write_text('{"extra": {"next_')
    mark_complete(it)
    (run.checkpoint / layout.TRACKER).write_text("2\n")
    return run


def test_status_leaves_out_cut_lines_and_names_a_damaged_trainer_state(run):
    s = run_status(run.root)
    assert (s["updates_done"], s["updates_total"]) == (2, 4)
    assert s["last_reward_per_k"] == {"2": {"update": 0, "reward_mean": 0.0}, "3": {"update": 1, "reward_mean": 0.25}}
    assert s["accuracy_per_k"] == {"2": {"update": 0, "when": "start", "accuracy": 0.5}}
    assert s["notes"] == [
        f"{path}: dropped a last line cut short by an interrupted write" for path in (run.metrics, run.evaluations)
    ]
    state = run.checkpoint / "iter_0000002" / "trainer_state.json"
    assert s["checkpoint"]["problem"].startswith(f"{state} is damaged (JSONDecodeError: ")


def test_plot_leaves_out_cut_lines(run):
    pytest.importorskip("matplotlib")
    notes = []
    assert plot_run(run.metrics, run.evaluations, run.plot, log=notes.append) == run.plot
    assert run.plot.stat().st_size > 0 and len(notes) == 2


def test_a_damaged_line_that_is_not_the_last_names_the_file_and_line(run):
    run.metrics.write_text(
        '{"update": 0, "k": 2, "rew\n' + json.dumps({"update": 1, "k": 3, "reward_mean": 0.0}) + "\n"
    )
    for read in (lambda: run_status(run.root), lambda: plot_run(run.metrics, run.evaluations, run.plot)):
        with pytest.raises(UserError) as err:
            read()
        assert str(err.value).startswith(f"{run.metrics}:1 is not valid JSON (")
