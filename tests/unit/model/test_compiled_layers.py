"""The execution setting `compile_layers` (default "auto"): each layer call of the
full-sequence forward runs as one compiled region (pointwise.region). On CPU with
`compile="always"` it gives the eager logits and gradients to fp32 rounding (the compiler
reorders reductions; bits are not promised), with mixed depths, packed documents and
recompute; the engine's eager prefill block keeps it off; "auto" steps aside for the
paged replay attention, "on" refuses it, and a bad value is a SettingError."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.errors import SettingError
from ouro_cli.model import build, compiling, pointwise, tiny_config
from ouro_cli.model.ouro import positions_per_loop
from ouro_cli.settings import ExecutionSettings

from .compiling import ALWAYS, forbid_compiles, record_compiles

pytestmark = pytest.mark.slow


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
    model.execution = ExecutionSettings(compile="always", compile_layers="on")
    logits, grads = run(model, recompute)
    assert "_layer_step" in compiled and "_layer_step_at_rows" in compiled  # loops of all and of some positions
    # inside the region the layer's own functions are traced inline; only the norm that opens
    # each loop (outside the layers) is still a compiled call of its own
    assert not {"rotary", "silu_mul", "add_rms_norm", "add_rms_norm_then_norm"} & set(compiled)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_new_token_shapes_do_not_recompile(monkeypatch):
    """The replay compiles once, shape-generic: after the first micro-batch (whose 2 rows and
    16 positions equal the tiny model's KV heads and head size, which duck sizing would
    have fused and specialised), other row counts and lengths compile nothing, nor do the
    other counts of running positions that the loops gathering them meet."""
    torch._dynamo.reset()  # nothing compiled by earlier tests
    compiling.compiled.cache_clear()
    model = build(tiny_config(), dtype=torch.float32, device="cpu", seed=0)
    model.execution = ALWAYS
    g = torch.Generator().manual_seed(0)
    spent, gathered = [], []
    for rows, length in ((2, 16), (3, 21), (5, 9)):
        ids = torch.randint(3, 100, (rows, length), generator=g)
        depths = torch.randint(1, model.config.num_loops + 1, (rows, length), generator=g)
        depths[:, :3] = model.config.num_loops  # mixed: every loop has active and exited positions
        gathered += [n for n in positions_per_loop(depths) if n < depths.numel()]
        before = compiling.compile_seconds()
        model(ids, depths).float().square().mean().backward()
        spent.append(compiling.compile_seconds() - before)
    assert spent[0] > 0 and spent[1:] == [0.0, 0.0], spent
    assert len(set(gathered)) >= 6, gathered


def test_eager_block_keeps_layers_uncompiled(monkeypatch):
    forbid_compiles(monkeypatch)
    model = build(tiny_config(), dtype=torch.float32, device="cpu", seed=0)
    model.execution = ExecutionSettings(compile="always", compile_layers="on")
    with pointwise.eager(), torch.no_grad():
        model(torch.randint(3, 100, (1, 8)))


@pytest.mark.parametrize(
    "mode,replay,on",
    [
        ("auto", "sdpa", True),
        ("auto", "paged", False),
        ("on", "sdpa", True),
        ("off", "sdpa", False),
        ("off", "paged", False),
    ],
)
def test_modes(mode, replay, on):
    assert ExecutionSettings(compile_layers=mode, replay_attention=replay).layer_regions is on


def test_bad_value_is_a_setting_error():
    with pytest.raises(SettingError, match="--compile-layers must be auto, on or off, got 'yes'"):
        ExecutionSettings(compile_layers="yes")
    # not traced: the paged replay launches Triton itself
    with pytest.raises(SettingError, match="--compile-layers on does not combine with --replay-attention paged"):
        ExecutionSettings(compile_layers="on", replay_attention="paged")


def test_masked_forward_runs_on_an_aligned_width_where_the_regions_compile(monkeypatch):
    """Where the layer regions compile, a padded or packed forward runs on a width that is a
    multiple of 8 (padding columns, masked out), and its logits are the eager ones at every
    real position: on CUDA a region guards on the attention bias's row alignment, and an
    unaligned micro-batch after an aligned one compiled both regions again (docs/performance.md#train). Eager, nothing
    is padded."""
    from ouro_cli.model import ouro

    widths = []
    build_layout = ouro.SequenceLayout.build

    def spy(input_ids, *args, **kwargs):
        widths.append(input_ids.shape[1])
        return build_layout(input_ids, *args, **kwargs)

    monkeypatch.setattr(ouro.SequenceLayout, "build", spy)
    model = build(tiny_config(), dtype=torch.float32, device="cpu", seed=0)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 100, (2, 13), generator=g)
    depths = torch.randint(1, model.config.num_loops + 1, (2, 13), generator=g)
    valid = torch.ones(2, 13, dtype=torch.long)
    valid[1, -4:] = 0
    eager = model(ids, depths, attention_mask=valid)
    model.execution = ExecutionSettings(compile="always", compile_layers="on")
    compiled = model(ids, depths, attention_mask=valid)
    assert widths == [13, 16]
    assert compiled.shape == eager.shape
    torch.testing.assert_close(compiled[valid.bool()], eager[valid.bool()], rtol=1e-5, atol=1e-5)
    unmasked = model(ids, depths)  # plain causal rows carry no mask: nothing to align
    assert widths[-1] == 13 and unmasked.shape == eager.shape
