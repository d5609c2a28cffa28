"""examples/ouro-1.4b/recipe.toml is a working `--config` file: every key is an option, and
`ouro train --config` runs it (on the tiny model, with its paths and sizes overridden by
flags, which is how the recipe's README tells a user to adapt it)."""

from __future__ import annotations

import json
from pathlib import Path

from ouro_cli.rl.options import BUNDLED, read_toml, resolve

from .test_train_cli import ouro

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "ouro-1.4b" / "recipe.toml"


def test_every_key_of_the_recipe_is_an_option_and_it_validates():
    values = read_toml(RECIPE)
    assert values["reward_function"] == "ouro_cli.rl.rewards.math_answer"
    options = resolve({"cuda_graphs": False, "device": "cpu"}, str(RECIPE))  # its own values, off the GPU
    assert options.gpu_memory_utilization == values["gpu_memory_utilization"]
    assert options.trainer.lr == values["lr"] and options.sampling.max_response_len == values["max_response_len"]


def test_train_runs_the_recipe_with_flags_over_it(tmp_path):
    """The recipe's own template (the tokenizer's chat template) and reward (the DeepScaleR
    grader) on the bundled model and data; besides those paths only the sizes change, to fit
    a CI machine, and CUDA graphs go off (no GPU)."""
    run = tmp_path / "run"
    sizes = [
        "--updates",
        "1",
        "--prompts-per-update",
        "2",
        "--group-size",
        "2",
        "--max-response-len",
        "8",
        "--eval-prompts",
        "2",
        "--eval-interval",
        "0",
        "--no-cuda-graphs",
    ]
    proc = ouro(
        "train",
        "--config",
        str(RECIPE),
        "--model",
        str(BUNDLED / "model"),
        "--data",
        str(BUNDLED / "train.jsonl"),
        "--eval-data",
        str(BUNDLED / "eval.jsonl"),
        "--run-dir",
        str(run),
        *sizes,
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["updates"] == 1
    plan = json.loads((run / "ouro-plan.json").read_text())
    contract = plan.get("contract", plan)
    assert contract["lr"] == 1e-6 and contract["group_size"] == 2  # the file's value, and a flag over it
    assert contract["reward_function"] == "ouro_cli.rl.rewards.math_answer"
    assert contract["prompt_template"] == "tokenizer"
