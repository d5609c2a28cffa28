"""Every writer goes through the output guard (ouro_cli/outputs.py).

The test walks the Typer application: each parameter of each command that names a file or
a directory is either an input or an output below, so a new path option fails here until it
is classified. Each output is then pointed, through the real command line (in this process),
inside a run directory's own files and at a folder that already holds something, and must be
refused with one line, exit 2, before anything is written there.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ouro_cli.cli.app import app
from ouro_cli.rl import plan as plans
from ouro_cli.rl.options import BUNDLED, TrainOptions

MODEL, EVAL = BUNDLED / "model", BUNDLED / "eval.jsonl"
PATH_NAME = re.compile(r"(^|_)(out|dir|data|model|hf|ckpt|run|config|files?|path)(_|$)")

INPUTS = {
    ("train", "config"),
    ("train", "model"),
    ("train", "data"),
    ("train", "eval_data"),
    ("resume", "run_dir"),
    ("resume", "eval_data"),
    ("eval", "model"),
    ("eval", "data"),
    ("export", "ckpt_or_run"),
    ("convert hf-to-mcore", "hf_dir"),
    ("convert mcore-to-hf", "ckpt"),
    ("verify-resume", "compare"),
    ("status", "run_dir"),
    ("plot", "run_dir"),
    ("compare", "run_a"),
    ("compare", "run_b"),
    ("data check", "files"),
    ("data check", "model"),
}

# output -> (the command line, with {OUT} for the output; what the output is; whether it has --overwrite)
OUTPUTS = {
    ("train", "run_dir"): (["train", "--updates", "1", "--run-dir", "{OUT}"], "dir", True),
    ("train", "export_hf"): (
        ["train", "--updates", "1", "--run-dir", "{TMP}/new-run", "--export-hf", "{OUT}"],
        "dir",
        True,
    ),
    ("resume", "export_hf"): (["resume", "{TMP}/other-run", "--updates", "1", "--export-hf", "{OUT}"], "dir", False),
    ("eval", "out"): (["eval", str(MODEL), "--data", str(EVAL), "--out", "{OUT}"], "dir", True),
    ("export", "out"): (["export", str(MODEL), "{OUT}"], "dir", True),
    ("convert hf-to-mcore", "out"): (["convert", "hf-to-mcore", str(MODEL), "{OUT}"], "dir", True),
    ("convert mcore-to-hf", "out"): (["convert", "mcore-to-hf", "{TMP}/mcore", "{OUT}"], "dir", True),
    ("verify-resume", "work_dir"): (
        ["verify-resume", "--updates", "2", "--resume-at", "1", "--work-dir", "{OUT}"],
        "dir",
        False,
    ),
    ("plot", "out"): (["plot", "{TMP}/run", "--out", "{OUT}"], "file", True),
    ("probe-ucx", "out"): (["probe-ucx", "--out", "{OUT}"], "probe.json", True),  # a folder for probe.json
}


def _commands(typer_app, prefix: tuple[str, ...] = ()):
    for info in typer_app.registered_commands:
        yield " ".join((*prefix, info.name or info.callback.__name__)), info.callback
    for group in typer_app.registered_groups:
        yield from _commands(group.typer_instance, (*prefix, group.name))


def _names_a_path(name: str, annotation) -> bool:
    return "Path" in repr(annotation) or "Path" in str(annotation) or bool(PATH_NAME.search(name))


def test_every_path_option_is_an_input_or_a_guarded_output():
    found = {
        (command, name)
        for command, callback in _commands(app)
        for name, parameter in inspect.signature(callback).parameters.items()
        if _names_a_path(name, parameter.annotation)
    }
    assert found == INPUTS | set(OUTPUTS), (
        "classify each new path option here; an output goes through "
        "ouro_cli/outputs.py and gets a command line in OUTPUTS"
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A run directory (RUN: its plan, records and a checkpoint), a second run to resume, and a
    Megatron checkpoint of the bundled model (for mcore-to-hf)."""
    from ouro_cli.checkpoint import open_checkpoint
    from ouro_cli.checkpoint.convert import to_megatron

    tmp = tmp_path_factory.mktemp("writers")
    plan = plans.new_plan(TrainOptions(), {}, {})  # the bundled model and data: absolute paths
    for name in ("run", "other-run"):
        run = tmp / name
        (run / "rollouts").mkdir(parents=True)
        (run / "rollouts" / "update_000000.jsonl").write_text("{}\n")
        (run / "metrics.jsonl").write_text(json.dumps({"update": 0, "k": 2, "reward_mean": 0.5}) + "\n")
        (run / "ouro-plan.json").write_text(json.dumps(plan))
    to_megatron(open_checkpoint(MODEL), tmp / "mcore", command="test", options={})
    return tmp


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _invoke(args: list[str]):
    result = CliRunner().invoke(app, args)
    text = " ".join(f"{result.stdout}\n{result.stderr}".split())
    assert "Traceback" not in text and result.exception is None or isinstance(result.exception, SystemExit), text
    return result.exit_code, text


@pytest.mark.parametrize("writer", sorted(OUTPUTS), ids=lambda w: f"{w[0]}:{w[1]}")
def test_each_output_is_refused_inside_a_run_and_when_it_holds_something(world, tmp_path, writer):
    args, kind, has_overwrite = OUTPUTS[writer]

    def line(out: Path, *extra: str) -> list[str]:
        return [a.replace("{OUT}", str(out)).replace("{TMP}", str(world)) for a in args] + list(extra)

    run_before = _tree(world / "run")
    inside = world / "run" / "rollouts" / ("new.png" if kind == "file" else "new")
    code, text = _invoke(line(inside, *(["--overwrite"] if has_overwrite else [])))
    assert code == 2 and f"lies inside the run directory {world / 'run'}" in text, text
    assert _tree(world / "run") == run_before and not inside.exists()

    taken = tmp_path / ("taken.png" if kind == "file" else "taken")
    if kind == "file":
        taken.write_text("mine")
    else:
        taken.mkdir()
        (taken / (kind if kind != "dir" else "notes.txt")).write_text("mine")
    before = _tree(tmp_path)
    code, text = _invoke(line(taken))
    assert code == 2 and re.search(r"is not empty|exists;", text), text
    assert _tree(tmp_path) == before
