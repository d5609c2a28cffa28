"""`ouro eval --prompt-template tokenizer` renders prompts with the checkpoint's own chat template.

The checkpoint is a copy of the bundled tiny model whose tokenizer_config.json carries a
chat template of its own: ChatML with a fixed system turn in front. Evaluating plain prompts
with that template must give exactly what the default ChatML template gives on the same
prompts written as [system, user] messages: same tokens, same seeds, same results.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ouro_cli.bundled import TINY
from ouro_cli.errors import UserError
from ouro_cli.rl.template import get_template, template_for_checkpoint

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "You are a helpful assistant."  # every word is in the tiny tokenizer's vocabulary
CHAT_TEMPLATE = (
    "{{ '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPTS = 8


def ouro(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "ouro_cli.cli.app", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def _model_with_chat_template(root: Path, chat_template: str | None) -> Path:
    model = root / "model"
    shutil.copytree(TINY / "model", model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model with the system-turn template, eval rows with string prompts, the same rows as messages)."""
    root = tmp_path_factory.mktemp("eval-template")
    model = _model_with_chat_template(root, CHAT_TEMPLATE)
    rows = [json.loads(line) for line in (TINY / "eval.jsonl").read_text().splitlines()[:PROMPTS]]
    plain, messages = root / "plain.jsonl", root / "messages.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    messages.write_text(
        "".join(
            json.dumps(
                {**r, "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["prompt"]}]}
            )
            + "\n"
            for r in rows
        )
    )
    return model, plain, messages


def test_tokenizer_template_is_the_checkpoints_own(chat_model):
    model, _, _ = chat_model
    template = template_for_checkpoint("tokenizer", model)
    assert template.text == CHAT_TEMPLATE
    expected = get_template("chatml").render(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 3*4+5?"}]
    )
    assert template.render("What is 3*4+5?") == expected


def test_eval_with_the_tokenizer_template_equals_chatml_on_the_same_text(chat_model, tmp_path):
    model, plain, messages = chat_model
    common = ["--depths", "2", "4", "--prompts", str(PROMPTS), "--device", "cpu", "--json"]
    by_template = ouro(
        "eval",
        str(model),
        "--data",
        str(plain),
        "--prompt-template",
        "tokenizer",
        "--out",
        str(tmp_path / "tokenizer"),
        *common,
        cwd=tmp_path,
    )
    assert by_template.returncode == 0, by_template.stderr
    by_chatml = ouro(
        "eval",
        str(model),
        "--data",
        str(messages),
        "--prompt-template",
        "chatml",
        "--out",
        str(tmp_path / "chatml"),
        *common,
        cwd=tmp_path,
    )
    assert by_chatml.returncode == 0, by_chatml.stderr
    got, want = json.loads(by_template.stdout)["evaluations"], json.loads(by_chatml.stdout)["evaluations"]
    assert [r["k"] for r in got] == [2, 4] and all(r["prompts"] == PROMPTS for r in got)
    assert got == want
    manifest = json.loads((tmp_path / "tokenizer" / "manifest.json").read_text())
    assert manifest["options"]["prompt_template"] == "tokenizer"


def test_tokenizer_template_without_a_chat_template_is_a_user_error(tmp_path):
    model = _model_with_chat_template(tmp_path, None)
    with pytest.raises(UserError, match="has no chat_template"):
        template_for_checkpoint("tokenizer", model)
