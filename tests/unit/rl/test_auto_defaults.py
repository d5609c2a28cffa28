"""The `auto` options follow the model (ouro_cli/defaults.py), the recipes under examples/
validate, and `ouro train --dry-run` reports data, options and memory plan from a model's
config and tokenizer alone (rl/dry_run.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ouro_cli import defaults
from ouro_cli.model.config import OuroConfig, tiny_config
from ouro_cli.rl import plan as plans
from ouro_cli.rl.options import BUNDLED, EvalOptions, resolve

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "examples").glob("ouro-*/*.toml"))


def config_only(root: Path, config: OuroConfig) -> Path:
    """An HF directory of config.json and the bundled tokenizer, no weights."""
    root.mkdir()
    config.save(root)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / "model" / name, root / name)
    return root


@pytest.fixture(scope="module")
def shaped_1_4b(tmp_path_factory) -> Path:
    return config_only(tmp_path_factory.mktemp("m") / "ouro-1.4b", OuroConfig())  # the defaults: Ouro-1.4B's shape


def test_the_bundled_model_and_tiny_models_take_the_tiny_task_values(tmp_path, shaped_1_4b):
    assert defaults.recipe_for(BUNDLED / "model") is defaults.TINY
    assert defaults.recipe_for(config_only(tmp_path / "tiny", tiny_config())) is defaults.TINY
    assert defaults.recipe_for(shaped_1_4b) is defaults.OURO_1_4B
    assert defaults.recipe_for(tmp_path / "absent") is defaults.OURO_1_4B


def test_the_other_models_values_are_the_shipped_1_4b_recipes():
    recipe = tomllib.loads((REPO / "examples" / "ouro-1.4b" / "recipe.toml").read_text())
    sections = {k: v for section in recipe.values() for k, v in section.items()}
    want = defaults.OURO_1_4B
    assert (sections["lr"], sections["max_response_len"], sections["eval_prompts"]) == (
        want.lr,
        want.max_response_len,
        want.eval_prompts,
    )


def test_auto_resolves_per_model_is_recorded_and_said(shaped_1_4b):
    tiny = resolve({}, None)
    assert (tiny.trainer.lr, tiny.sampling.max_response_len, tiny.eval_prompts) == (1e-4, 48, 200)
    big = resolve({"model": str(shaped_1_4b), "eval_prompts": 7}, None)
    assert (big.trainer.lr, big.sampling.max_response_len, big.eval_prompts) == (1e-6, 2048, 7)
    assert [c.note for c in big.chosen] == [
        "--lr auto → 1e-6 (the 1.4B recipe's; pass --lr to choose)",
        "--max-response-len auto → 2048 (the 1.4B recipe's; pass --max-response-len to choose)",
    ]
    recorded = big.to_dict()  # what the manifest and the plan hold: the resolved values
    assert (recorded["lr"], recorded["max_response_len"]) == (1e-6, 2048)
    # a resume rebuilds the options from the plan: the values, not `auto`, so nothing is chosen again
    plan = plans.new_plan(big, {}, {})
    again = plans.resume_options(plan, {}, updates=big.updates + 1, run_dir=str(big.run_dir))
    assert (again.trainer.lr, again.sampling.max_response_len, again.chosen) == (1e-6, 2048, [])


def test_eval_sizes_follow_the_model(shaped_1_4b):
    tiny = EvalOptions(model=str(BUNDLED / "model"), data=str(BUNDLED / "eval.jsonl")).validate()
    assert (tiny.prompts, tiny.sampling.max_response_len) == (64, 48)
    big = EvalOptions(model=str(shaped_1_4b), data=str(BUNDLED / "eval.jsonl")).validate()
    assert (big.prompts, big.sampling.max_response_len) == (500, 2048)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_recipe_validates_and_says_which_reward_and_why(recipe):
    options = resolve({"cuda_graphs": False, "device": "cpu"}, str(recipe))
    thinking = "Thinking" in options.model
    assert options.task.reward_function.endswith("math_answer" if thinking else "math_verify_answer")
    assert options.chosen == []  # a recipe states its sizes
    head = recipe.read_text().split("[data]")[0]
    assert "Reward:" in head and ("</think>" in head)


def test_dry_run_reads_no_weights_and_reports_the_plan(shaped_1_4b):
    from ouro_cli.rl.dry_run import dry_run

    tiny = dry_run(resolve({"device": "cpu"}, None))
    assert tiny.memory_error is None and tiny.memory["kv_blocks"] > 0
    assert tiny.data["rows"] == 2727 and tiny.data["seq_tokens"] == tiny.data["longest_prompt_tokens"] + 48
    assert tiny.memory_line.startswith("memory: ")
    big = dry_run(resolve({"model": str(shaped_1_4b), "device": "cpu", "max_response_len": 256}, None))
    assert big.model["layers"] == 24 and 1.3e9 < big.model["parameters"] < 1.5e9
    # this host's memory decides whether it fits; either way the report says which
    assert (big.memory_error is None) == bool(big.memory.get("kv_blocks"))
    document = big.document()
    assert document["options"]["lr"] == 1e-6 and document["auto"] == {"--lr": 1e-6, "--eval-prompts": 500}


def test_dry_run_sizes_the_plan_for_a_named_gpu_from_any_machine(shaped_1_4b):
    from ouro_cli.rl.dry_run import dry_run

    options = resolve({"model": str(shaped_1_4b)}, None)
    h200 = dry_run(options, gpu_gib=141)
    assert h200.memory_error is None and h200.memory["device"].startswith("cuda (141 GiB")
    assert h200.memory["budget_bytes"] == int(0.9 * 141 * 2**30) and h200.memory["kv_blocks"] > 0
    assert h200.model["dtype"] == "bfloat16" and "of 141.0 GiB (cuda)" in h200.memory_line
    small = dry_run(options, gpu_gib=8)
    assert small.memory_error is not None and "does not fit" in str(small.memory_error)


def test_train_dry_run_on_the_command_line_writes_nothing(tmp_path):
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "ouro_cli.cli.app", "train", "--dry-run", "--device", "cpu", "--run-dir", "r", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert document["ok"] and document["dry_run"] and document["options"]["lr"] == 1e-4
    assert "--lr auto → 1e-4 (the bundled tiny task's; pass --lr to choose)" in proc.stderr
    assert list(tmp_path.iterdir()) == []
