"""Tiny Ouro checkpoints on disk for the checkpoint tests: an HF directory with the
tokenizer and remote-code files a real one carries."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ouro_cli.checkpoint import write_hf
from ouro_cli.model import OuroForCausalLM, build, tiny_config

ASSET_FILES = {
    "modeling_ouro.py": "# remote code stand-in\nclass OuroForCausalLM: ...\n",
    "configuration_ouro.py": "# remote code stand-in\nclass OuroConfig: ...\n",
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE"}}),
    "tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"}),
    "special_tokens_map.json": json.dumps({"eos_token": "<|endoftext|>"}),
    "generation_config.json": json.dumps({"eos_token_id": [0, 2]}),
}


def tiny_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> OuroForCausalLM:
    return build(tiny_config(), dtype=dtype, seed=seed)


def write_tiny_hf(path: Path, model: OuroForCausalLM, *, max_shard_bytes: int = 10**9) -> Path:
    """An HF directory for `model` with the asset files, as a downloaded checkpoint looks."""
    path.mkdir(parents=True, exist_ok=True)
    assets = path.parent / f".{path.name}-assets"
    assets.mkdir(exist_ok=True)
    for name, text in ASSET_FILES.items():
        (assets / name).write_text(text)
    write_hf(path, model.config, model.state_dict().items(), max_shard_bytes=max_shard_bytes, assets_from=assets)
    return path


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
