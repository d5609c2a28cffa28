"""A run's files are recorded absolute (rl/options.py `TrainOptions.absolute`, rl/plan.py): a
run started with relative paths resumes from another folder on the same files, a path given
to the resume is relative to where it runs, and a missing file is named by its flag with its
path as first given (rl/loop.py)."""

from __future__ import annotations

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl import plan as plans
from ouro_cli.rl.loop import _check_present
from ouro_cli.rl.options import BUNDLED, resolve


def test_relative_paths_are_recorded_absolute_and_a_resume_elsewhere_keeps_them(tmp_path, monkeypatch):
    started, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    for folder in (started, elsewhere):
        folder.mkdir()
        (folder / "ev.jsonl").write_text((BUNDLED / "eval.jsonl").read_text())
    (started / "train.jsonl").write_text((BUNDLED / "train.jsonl").read_text())
    monkeypatch.chdir(started)
    options = resolve({"data": "train.jsonl", "eval_data": "ev.jsonl", "export_hf": "out/hf"}, None)
    assert (options.data, options.eval_data, options.export_hf) == (
        str(started / "train.jsonl"),
        str(started / "ev.jsonl"),
        str(started / "out" / "hf"),
    )
    assert options.given_paths == {"data": "train.jsonl", "eval_data": "ev.jsonl", "export_hf": "out/hf"}
    plan = plans.new_plan(options, {}, {})

    monkeypatch.chdir(elsewhere)
    resumed = plans.resume_options(plan, {"eval_data": "ev.jsonl"}, updates=3, run_dir="run")
    assert resumed.data == str(started / "train.jsonl") and resumed.eval_data == str(elsewhere / "ev.jsonl")
    assert resumed.given_paths == {"data": "train.jsonl", "eval_data": "ev.jsonl", "export_hf": "out/hf"}
    _check_present(resumed)

    (started / "ev.jsonl").unlink()
    with pytest.raises(UserError) as err:
        _check_present(plans.resume_options(plan, {}, updates=3, run_dir="run"))
    assert str(err.value) == (
        f"the held-out set --eval-data {started / 'ev.jsonl'} (given as ev.jsonl) does not "
        "exist; it is not part of the run's contract: pass --eval-data with another held-out "
        "file, or --eval-data '' to evaluate nothing"
    )
    (started / "train.jsonl").unlink()
    with pytest.raises(
        UserError,
        match=rf"the training data --data {started / 'train.jsonl'} \(given as "
        r"train.jsonl\) does not exist",
    ):
        _check_present(plans.resume_options(plan, {"eval_data": ""}, updates=3, run_dir="run"))
