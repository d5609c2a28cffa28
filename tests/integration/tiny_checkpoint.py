"""A tiny Ouro HF checkpoint with a character-level tokenizer and arithmetic data, for CLI tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ouro_cli.checkpoint import write_hf
from ouro_cli.model import build, tiny_config

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("0123456789+-*=?{}\\ \nabcdefghijklmnopqrstuvwxyz<>/")


def make_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    return tok


def make_checkpoint(root: Path, seed: int = 0, *, mixed_exits: bool = False) -> Path:
    """root/hf (HF checkpoint + tokenizer.json), root/train.jsonl, root/eval.jsonl. With
    `mixed_exits` the exit gate varies from token to token enough that `--exit-threshold 0.7`
    exits decoded tokens at mixed depths under every budget K = 2, 3, 4."""
    assets = root / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    make_tokenizer().save(str(assets / "tokenizer.json"))
    (assets / "modeling_ouro.py").write_text("# remote code stand-in: must travel with the checkpoint\n")
    config = tiny_config(vocab_size=64)
    hf = root / "hf"
    hf.mkdir()
    model = build(config, seed=seed)
    if mixed_exits:
        gate = model.model.early_exit_gate
        with torch.no_grad():
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(seed + 1)))
            gate.bias.fill_(-0.5)
    write_hf(hf, config, model.state_dict().items(), assets_from=assets)
    rows = [
        {"prompt": f"{i % 7}+{i % 5}=?", "label": i % 7 + i % 5, "metadata": {"problem_id": f"p{i}"}} for i in range(40)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))
    return hf


def digit_reward(response: str, label) -> float:
    """A test reward that varies across samples of an untrained model (fraction of digits),
    so GRPO has a non-zero signal and the weights visibly move."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


REWARD = "tests.integration.tiny_checkpoint:digit_reward"


def first_digit_reward(response: str, label) -> float:
    """A binary test reward (the response starts with a digit) that an untrained model often gets
    equal across a group, so that --filter-groups drops groups and refills the update."""
    return float(response[:1].isdigit())


BINARY_REWARD = "tests.integration.tiny_checkpoint:first_digit_reward"
