"""The bundled tiny model and data (ouro_cli/bundled/tiny/) are what `ouro train` uses by default.

These checks read the shipped files only; regenerating them (examples/tiny/generate.py)
takes minutes and is not part of the test run. The bundle is package data, so that an
installed wheel (not only a clone) finds it: pyproject.toml must list every file of it.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path

import pytest
import torch

from ouro_cli.bundled import TINY

REPO = Path(__file__).resolve().parents[2]
MODEL = TINY / "model"
CHATML = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TINY / name).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(MODEL / "tokenizer.json"))


def test_files_match_recorded_sha256():
    lines = (TINY / "SHA256SUMS").read_text().splitlines()  # `sha256sum -c` format
    recorded = {name: digest for digest, name in (line.split(None, 1) for line in lines)}
    assert "model/model.safetensors" in recorded
    for name, digest in recorded.items():
        assert hashlib.sha256((TINY / name).read_bytes()).hexdigest() == digest, f"{name} differs from SHA256SUMS"


def test_config_is_a_four_loop_ouro():
    from ouro_cli.model import OuroConfig

    config = OuroConfig.from_file(MODEL)
    assert config.model_type == "ouro"
    assert config.total_ut_steps == 4
    assert config.tie_word_embeddings is False
    assert config.early_exit_threshold == 1.0
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 0, 0)
    assert config.extra["architectures"] == ["OuroForCausalLM"]
    assert set(config.extra["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}


def test_checkpoint_loads_and_runs_at_every_depth(tokenizer):
    from ouro_cli.model import load

    model = load(MODEL)
    assert (MODEL / "model.safetensors").stat().st_size < 4 * 2**20
    assert "model.early_exit_gate.weight" in model.state_dict()
    ids = torch.tensor([tokenizer.encode(CHATML.format(prompt="What is 7*8+3?"), add_special_tokens=False).ids])
    assert int(ids.max()) < model.config.vocab_size
    with torch.no_grad():
        for k in range(1, 5):
            depths = torch.full_like(ids, 4)
            depths[0, -3:] = k
            logits = model(ids, depths=depths)
            assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
            assert torch.isfinite(logits).all()


def test_tokenizer_ids_and_round_trip(tokenizer):
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    for text in ("\\boxed{12}", "<think>7*8=56\n56+3=59</think>\\boxed{59}"):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.token_to_id("<unk>") not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = CHATML.format(prompt="What is 3*4-2?") + "\\boxed{10}<|im_end|>"
    ids = tokenizer.encode(chat, add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=False) == chat
    boxed = tokenizer.encode("\\boxed{", add_special_tokens=False).ids
    assert len(boxed) == 1  # one token, so a sampled response cannot split the marker oddly


def test_tokenizer_config_is_chatml():
    cfg = json.loads((MODEL / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == cfg["eos_token"] == cfg["pad_token"] == "<|endoftext|>"
    jinja2 = pytest.importorskip("jinja2")
    rendered = (
        jinja2.Environment()
        .from_string(cfg["chat_template"])
        .render(messages=[{"role": "user", "content": "What is 7+5?"}], add_generation_prompt=True)
    )
    assert rendered == CHATML.format(prompt="What is 7+5?")


@pytest.mark.parametrize("name", ["train.jsonl", "eval.jsonl"])
def test_data_rows_parse_with_integer_labels(name):
    rows = _rows(name)
    assert len(rows) >= 200
    split = name.split(".")[0]
    for row in rows:
        assert isinstance(row["prompt"], str) and row["prompt"]
        assert type(row["label"]) is int
        assert row["metadata"]["problem_id"].startswith(f"{split}-")
        expr = re.fullmatch(r"What is ([0-9+\-*]+)\?", row["prompt"]).group(1)
        assert eval(expr, {"__builtins__": {}}) == row["label"]  # digits and + - * only
    assert len({r["metadata"]["problem_id"] for r in rows}) == len(rows)


def test_train_and_eval_do_not_overlap():
    train, held_out = _rows("train.jsonl"), _rows("eval.jsonl")
    assert not {r["metadata"]["problem_id"] for r in train} & {r["metadata"]["problem_id"] for r in held_out}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_bundle_is_package_data_and_the_train_default():
    """Every bundled file matches a package-data pattern of pyproject.toml (what a wheel
    ships), and `ouro train`'s defaults point into the bundle."""
    from ouro_cli.rl.options import BUNDLED, TrainOptions

    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package_dir = TINY.parent
    shipped = {
        path for pattern in package_data["ouro_cli.bundled"] for path in package_dir.glob(pattern) if path.is_file()
    }
    files = {path for path in TINY.rglob("*") if path.is_file() and "__pycache__" not in path.parts}
    assert files and files <= shipped, f"not package data: {sorted(str(p) for p in files - shipped)}"
    assert BUNDLED == TINY
    options = TrainOptions()
    for default in (options.model, options.data, options.eval_data):
        assert Path(default).is_relative_to(TINY) and Path(default).exists(), default
