"""examples/ouro-1.4b/recipe.toml is a working `--config` file: every key is an option, and
`ouro train --config` runs it (on the tiny model, with its paths and sizes overridden by
flags, which is how the recipe's README tells a user to adapt it)."""

from __future__ import annotations

import json
from pathlib import Path

from ouro_cli.rl.options import read_toml, resolve

from .test_train_cli import ouro, small
from .tiny_checkpoint import make_checkpoint

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "ouro-1.4b" / "recipe.toml"


def test_every_key_of_the_recipe_is_an_option_and_it_validates():
    values = read_toml(RECIPE)
    assert values["reward_function"] == "ouro_cli.rl.rewards.math_answer"
    options = resolve({"cuda_graphs": False, "device": "cpu"}, str(RECIPE))  # its own values, off the GPU
    assert options.gpu_memory_utilization == values["gpu_memory_utilization"]
    assert options.trainer.lr == values["lr"] and options.sampling.max_response_len == values["max_response_len"]


def test_train_runs_the_recipe_with_flags_over_it(tmp_path):
    make_checkpoint(tmp_path)
    run = tmp_path / "run"
    proc = ouro("train", "--config", str(RECIPE), *small(tmp_path), "--run-dir", str(run), "--updates", "1",
                "--prompt-template", "chatml", "--no-cuda-graphs", "--eval-interval", "0", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["updates"] == 1
    plan = json.loads((run / "ouro-plan.json").read_text())
    contract = plan.get("contract", plan)
    assert contract["lr"] == 1e-6 and contract["group_size"] == 3  # the file's value, and a flag over it
