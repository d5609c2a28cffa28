"""Fixtures for the engine tests: tiny fp32 models and the engine factories under test.

The contract and conformance tests take `make_engine`, parametrised over engine
factories: the built-in `LLM` plus any listed in OURO_ENGINE_FACTORIES (comma
separated dotted paths), so another implementation is checked by the same suite. A
factory is called as `factory(model, **options)` with a loaded tiny OuroForCausalLM.
"""

from __future__ import annotations

import os

import pytest
import torch

from ouro_cli.engine import DEFAULT_FACTORY, load_factory
from ouro_cli.model import build, tiny_config

ENGINE_FACTORIES = [DEFAULT_FACTORY] + [
    f.strip() for f in os.environ.get("OURO_ENGINE_FACTORIES", "").split(",") if f.strip()
]


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


def tiny_model(seed: int = 0, *, mixed_exits: bool = True, **overrides):
    """A random tiny Ouro (T = 4, 2 layers, GQA) whose gate makes tokens exit at mixed depths
    under exit_threshold 0.5.

    std 0.12 makes logits clearly non-uniform while keeping the fp32 forward well
    conditioned: at std 0.2 two fp32 evaluations of the same math (engine, replay) each
    sit ~2e-5 from fp64, so a 1e-5 check would measure rounding, not the engine."""
    cfg = tiny_config(vocab_size=96, **overrides)
    model = build(cfg, dtype=torch.float32, seed=seed, std=0.12)
    if mixed_exits:
        gate = model.model.early_exit_gate
        with torch.no_grad():
            gate.weight.copy_(0.2 * torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(seed + 1)))
            gate.bias.fill_(-1.0)
    return model


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 12, vocab: int = 96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (m,), generator=g).tolist() for m in lengths]


@pytest.fixture(params=ENGINE_FACTORIES)
def make_engine(request):
    return load_factory(request.param)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)
