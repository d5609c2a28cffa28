"""OURO_COMPILE_LAYERS (default "auto"): each layer call of the full-sequence forward runs as
one compiled region (pointwise.region). On CPU with OURO_COMPILE=always it gives the eager
logits and gradients to fp32 rounding (the compiler reorders reductions; bits are not
promised), with mixed depths, packed documents and recompute; the engine's eager prefill
block keeps it off; "auto" steps aside for the paged replay attention, "1" refuses it, and
a bad value is a SettingError."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.errors import SettingError
from ouro_cli.model import build, pointwise, tiny_config

from .compiling import forbid_compiles, record_compiles


def run(model, recompute: bool):
    """Logits and parameter gradients of one forward/backward with mixed depths and two
    documents packed in a row (tests/gpu reuses it on CUDA)."""
    g = torch.Generator().manual_seed(3)
    device = next(model.parameters()).device
    ids = torch.randint(3, 100, (2, 16), generator=g).to(device)
    depths = torch.randint(1, model.config.num_loops + 1, (2, 16), generator=g).to(device)
    docs = torch.tensor([[0] * 8 + [1] * 8, [0] * 16], device=device)
    model.zero_grad()
    logits = model(ids, depths, document_ids=docs, recompute=recompute)
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_compiled_layers_match_eager(monkeypatch, recompute):
    model = build(tiny_config(), dtype=torch.float32, device="cpu", seed=0)
    eager_logits, eager_grads = run(model, recompute)
    compiled = record_compiles(monkeypatch)
    monkeypatch.setenv("OURO_COMPILE_LAYERS", "1")
    logits, grads = run(model, recompute)
    assert "_layer_step" in compiled
    # inside the region the layer's own functions are traced inline; only the norm that opens
    # each loop (outside the layers) is still a compiled call of its own
    assert not {"_rotary", "_silu_mul", "_add_rms_norm", "_add_rms_norm_then_norm"} & set(compiled)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_new_token_shapes_do_not_recompile(monkeypatch):
    """The replay compiles once, shape-generic: after the first micro-batch (whose 2 rows and
    16 positions equal the tiny model's KV heads and head size, which duck sizing would
    have fused and specialised), other row counts and lengths compile nothing."""
    monkeypatch.setenv("OURO_COMPILE", "always")
    torch._dynamo.reset()  # nothing compiled by earlier tests
    pointwise._compiled.cache_clear()
    model = build(tiny_config(), dtype=torch.float32, device="cpu", seed=0)
    g = torch.Generator().manual_seed(0)
    spent = []
    for rows, length in ((2, 16), (3, 21), (5, 9)):
        ids = torch.randint(3, 100, (rows, length), generator=g)
        depths = torch.randint(1, model.config.num_loops + 1, (rows, length), generator=g)
        depths[:, :3] = model.config.num_loops  # mixed: every loop has active and exited positions
        before = pointwise.compile_seconds()
        model(ids, depths).float().square().mean().backward()
        spent.append(pointwise.compile_seconds() - before)
    assert spent[0] > 0 and spent[1:] == [0.0, 0.0], spent


def test_eager_block_keeps_layers_uncompiled(monkeypatch):
    monkeypatch.setenv("OURO_COMPILE", "always")
    monkeypatch.setenv("OURO_COMPILE_LAYERS", "1")
    forbid_compiles(monkeypatch)
    model = build(tiny_config(), dtype=torch.float32, device="cpu", seed=0)
    with pointwise.eager(), torch.no_grad():
        model(torch.randint(3, 100, (1, 8)))


@pytest.mark.parametrize("mode,replay,on", [(None, None, True), ("auto", "sdpa", True), (None, "paged", False),
                                            ("1", None, True), ("0", None, False), ("0", "paged", False)])
def test_modes(monkeypatch, mode, replay, on):
    for name, value in (("OURO_COMPILE_LAYERS", mode), ("OURO_REPLAY_ATTENTION", replay)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert pointwise.compile_layers() is on


def test_bad_value_is_a_setting_error(monkeypatch):
    monkeypatch.setenv("OURO_COMPILE_LAYERS", "yes")
    with pytest.raises(SettingError, match="OURO_COMPILE_LAYERS must be auto, 0 or 1"):
        pointwise.compile_layers()
    monkeypatch.setenv("OURO_COMPILE_LAYERS", "1")
    monkeypatch.setenv("OURO_REPLAY_ATTENTION", "paged")  # not traced: the paged replay launches Triton itself
    with pytest.raises(SettingError, match="does not combine with OURO_REPLAY_ATTENTION=paged"):
        pointwise.compile_layers()
