"""The help states the options' own defaults and what they accept: every flag of `ouro train`
and `ouro eval` shows `[default: X]` with X the default its field holds in the option tree
(rl/options.py, trainer/config.py), and `ouro resume` shows "the run's". A default stated in
words stands only for one that is None, a path (the bundled model) or the built-in engine's
dotted path (too long for an 80-column help); the trainer's defaults are the job's, since the
job nests the trainer's own config. An `auto` default says what it resolves to for the bundled
model and for any other (ouro_cli/defaults.py); an option with a fixed set of values names
each; an option that reads data names every format the reader takes (rl/data_formats.py)."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
from dataclasses import MISSING
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest

from ouro_cli import defaults
from ouro_cli.config import leaves
from ouro_cli.rl.options import BUNDLED, DEFAULT_ENGINE, EvalOptions, TrainOptions
from ouro_cli.trainer.config import TrainerConfig

REPO = Path(__file__).resolve().parents[3]
DEFAULT = re.compile(r"\[default: (.*)\]\s*$")


@functools.cache
def help_text(*command: str) -> str:
    """`ouro COMMAND --help` at 1000 columns (one line per help row)."""
    env = {
        **os.environ,
        "COLUMNS": "1000",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "ouro_cli.cli.app", *command, "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def shown_defaults(command: str) -> dict[str, str]:
    """Flag -> the default its help row states (rows joined over wrapped lines)."""
    rows = {}
    for line in help_text(command).splitlines():
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
        if instance is not None and leaf.default == defaults.AUTO and leaf.name in defaults.Recipe.__dataclass_fields__:
            # options are built resolved: `auto` holds the bundled model's value (ouro_cli/defaults.py)
            assert value == getattr(defaults.TINY, leaf.name), flag
            value = leaf.default
        assert value == leaf.default
        if leaf.info.shown is not None:  # words only for an unset default or a path
            assert value in (None, [], DEFAULT_ENGINE) or Path(value).is_relative_to(BUNDLED), flag
            assert shown[flag] == leaf.info.shown, flag
        else:
            assert shown[flag] == expected(value), flag


def test_the_trainer_defaults_are_the_jobs():
    job = TrainOptions().trainer  # its lr resolved for the bundled model, which a trainer alone uses for auto
    assert dataclasses.replace(job, lr=defaults.AUTO) == TrainerConfig()
    assert job.lr == TrainerConfig().learning_rate == defaults.TINY.lr
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


def help_rows(command: str) -> dict[str, str]:
    """Flag -> its whole help row."""
    rows = {}
    for line in help_text(command).splitlines():
        cells = line.strip("│ ").split()
        if line.startswith("│") and cells and cells[0] == "*":
            cells = cells[1:]
        if line.startswith("│") and cells and cells[0].startswith("--"):
            rows[cells[0]] = line
    return rows


@pytest.mark.parametrize("command, root", [("train", TrainOptions), ("eval", EvalOptions)])
def test_auto_and_choices_are_spelled_out(command, root):
    """An `auto` default names both values it stands for; a fixed set of values is listed whole."""
    rows = help_rows(command)
    for leaf in leaves(root).values():
        row = rows.get(leaf.flag.split("/")[0])
        if leaf.default == defaults.AUTO and leaf.name in defaults.Recipe.__dataclass_fields__:
            for recipe in (defaults.TINY, defaults.OURO_1_4B):
                assert defaults.number(getattr(recipe, leaf.name)) in row, (leaf.flag, row)
        if get_origin(leaf.type) is Literal:
            for value in get_args(leaf.type):
                assert value in row, (leaf.flag, value, row)


def test_options_that_read_data_name_every_format():
    for command, flag in (("train", "--data"), ("train", "--eval-data"), ("eval", "--data")):
        row = help_rows(command)[flag]
        assert all(word in row for word in ("JSONL", "Parquet", "datasets save_to_disk directory")), (flag, row)


def test_the_help_agrees_with_itself():
    rows = help_rows("train")
    assert "on by default" not in rows["--cuda-graphs"] and "[default: off]" in rows["--cuda-graphs"]
    assert "counted in updates" in rows["--warmup-steps"]  # as docs/grpo.md says: W updates = W x N x E steps
    assert "Usage: ouro eval [OPTIONS] MODEL" in help_text("eval")
    assert "Usage: ouro export [OPTIONS] CKPT_OR_RUN OUT" in help_text("export")
    commands = [line.split()[1] for line in help_text().split("Commands")[1].splitlines() if line.startswith("│ ")]
    assert commands[:3] == ["train", "resume", "eval"] and {"data", "convert", "export"} <= set(commands)
    assert "--dry-run" in help_rows("train")
