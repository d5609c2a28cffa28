"""The help states the options' own defaults: every flag of `ouro train` and `ouro eval` shows
`[default: X]` with X the default its field holds in the option tree (rl/options.py,
trainer/config.py), and `ouro resume` shows "the run's". A default stated in words stands
only for one that is None, a path (the bundled model) or the built-in engine's dotted path
(too long for an 80-column help); the trainer's defaults are the job's, since the job nests
the trainer's own config."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import MISSING
from pathlib import Path

import pytest

from ouro_cli.config import leaves
from ouro_cli.rl.options import BUNDLED, DEFAULT_ENGINE, EvalOptions, TrainOptions
from ouro_cli.trainer.config import TrainerConfig

REPO = Path(__file__).resolve().parents[3]
DEFAULT = re.compile(r"\[default: (.*)\]\s*$")


def shown_defaults(command: str) -> dict[str, str]:
    """Flag -> the default its help row states (rows joined over wrapped lines)."""
    env = {
        **os.environ,
        "COLUMNS": "1000",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "ouro_cli.cli.app", command, "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        if not line.startswith("│"):  # outside the option panels (the examples name flags too)
            continue
        cells = line.strip("│ ").split()
        if cells and cells[0] == "*":
            cells = cells[1:]
        if cells and cells[0].startswith("--"):
            found = DEFAULT.search(line.rstrip("│ "))
            rows[cells[0]] = found.group(1) if found else None
    return rows


def expected(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


@pytest.mark.parametrize("command, root", [("train", TrainOptions), ("eval", EvalOptions)])
def test_every_flag_shows_the_default_its_option_holds(command, root):
    shown = shown_defaults(command)
    instance = None if root is EvalOptions else root()
    for leaf in leaves(root).values():
        if leaf.info.argument:
            continue
        flag = leaf.flag.split("/")[0]
        assert flag in shown, flag
        if leaf.default is MISSING:
            assert shown[flag] is None, flag  # [required]
            continue
        value = leaf.get(instance) if instance is not None else leaf.default
        assert value == leaf.default
        if leaf.info.shown is not None:  # words only for an unset default or a path
            assert value in (None, [], DEFAULT_ENGINE) or Path(value).is_relative_to(BUNDLED), flag
            assert shown[flag] == leaf.info.shown, flag
        else:
            assert shown[flag] == expected(value), flag


def test_the_trainer_defaults_are_the_jobs():
    assert TrainOptions().trainer == TrainerConfig()
    shown = shown_defaults("train")
    config = TrainerConfig()
    assert (shown["--lr"], shown["--keep-last"], shown["--seed"]) == (
        str(config.lr),
        str(config.keep_last),
        str(config.seed),
    )


def test_resume_states_the_runs_value_for_what_it_takes():
    shown = shown_defaults("resume")
    assert shown.pop("--verbose") == "off"  # what the command shows, not an option of the run
    del shown["--updates"], shown["--json"], shown["--help"], shown["--override-scheduler"]
    assert shown and set(shown.values()) == {"the run's"}
