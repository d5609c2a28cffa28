"""The physical name/shape table, wrapper-prefix stripping and the mismatch report."""

from __future__ import annotations

import pytest

from ouro_cli.checkpoint import (
    CheckpointError,
    check_tensors,
    expected_shapes,
    strip_wrapper_prefixes,
)
from ouro_cli.checkpoint.names import parameter_count
from ouro_cli.errors import UserError
from ouro_cli.model import OuroConfig, tiny_config


def test_ouro_14b_table_has_269_tensors_and_the_published_parameter_count():
    shapes = expected_shapes(OuroConfig())  # built on the meta device: nothing allocated
    assert len(shapes) == 269
    assert parameter_count(shapes.values()) == 1_434_652_673
    per_layer = [n for n in shapes if n.startswith("model.layers.0.")]
    assert len(per_layer) == 11
    assert shapes["model.embed_tokens.weight"] == (49152, 2048)
    assert shapes["lm_head.weight"] == (49152, 2048)
    assert shapes["model.early_exit_gate.weight"] == (1, 2048)
    assert shapes["model.early_exit_gate.bias"] == (1,)
    assert shapes["model.layers.23.post_attention_layernorm_2.weight"] == (2048,)
    assert not any("rotary" in n or "inv_freq" in n for n in shapes)


def test_gqa_shapes_follow_the_config():
    shapes = expected_shapes(tiny_config())  # 4 heads, 2 kv heads, head_dim 16
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (64, 64)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    assert shapes["model.layers.1.self_attn.v_proj.weight"] == (32, 64)


@pytest.mark.parametrize(
    "wrapped, physical",
    [
        ("model.norm.weight", "model.norm.weight"),
        ("module.model.norm.weight", "model.norm.weight"),
        ("language_model.lm_head.weight", "lm_head.weight"),
        ("module.language_model.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("module.module.language_model.module.lm_head.weight", "lm_head.weight"),
        ("optimizer.module.lm_head.weight", "optimizer.module.lm_head.weight"),  # only leading prefixes
    ],
)
def test_strip_wrapper_prefixes(wrapped, physical):
    assert strip_wrapper_prefixes(wrapped) == physical


def test_mismatch_report_names_every_problem_in_one_line():
    expected = {"a": (2, 3), "b": (4,), "c": (1,)}
    found = {"a": (3, 2), "c": (1,), "zzz": (5,)}
    with pytest.raises(CheckpointError) as err:
        check_tensors("ckpt", found, expected)
    message = str(err.value)
    assert isinstance(err.value, UserError)
    assert "\n" not in message
    assert "1 missing tensors: b" in message
    assert "1 unexpected tensors: zzz" in message
    assert "a [3, 2] (expected [2, 3])" in message
    check_tensors("ckpt", {"a": (2, 3), "b": (4,), "c": (1,), "opt": (9,)}, expected, allow_unexpected=True)


def test_long_lists_are_abbreviated():
    expected = {f"t{i}": (1,) for i in range(10)}
    with pytest.raises(CheckpointError, match=r"10 missing tensors: t0, t1, t2, and 7 more"):
        check_tensors("ckpt", {}, expected)
