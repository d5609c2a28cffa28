"""config.json handling, the 1.4B parameter count, and the exit-gate distribution."""

from __future__ import annotations

import json

import pytest
import torch

from ouro_cli.model import ConfigError, OuroConfig, OuroForCausalLM, exit_cdf, exit_distribution
from ouro_cli.model.exit_gate import cdf_step

from .reference import reference_exit_cdf

# The shape of the public Ouro-1.4B config.json (values from docs/model.md §1).
OURO_14B_CONFIG = {
    "architectures": ["OuroForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_ouro.OuroConfig",
        "AutoModel": "modeling_ouro.OuroModel",
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
    },
    "bos_token_id": 0,
    "early_exit_threshold": 1.0,
    "eos_token_id": 0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "layer_types": ["full_attention"] * 24,
    "max_position_embeddings": 65536,
    "max_window_layers": 24,
    "model_type": "ouro",
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "total_ut_steps": 4,
    "transformers_version": "4.55.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 49152,
}


def test_real_config_loads_and_round_trips(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OURO_14B_CONFIG))
    cfg = OuroConfig.from_file(tmp_path)
    assert cfg.dim_per_head == 128 and cfg.total_ut_steps == 4
    assert cfg.extra["auto_map"]["AutoConfig"] == "configuration_ouro.OuroConfig"
    out = tmp_path / "out"
    out.mkdir()
    cfg.save(out)
    assert json.loads((out / "config.json").read_text()) == OURO_14B_CONFIG


def test_ouro_14b_has_269_tensors_and_exact_parameter_count(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OURO_14B_CONFIG))
    with torch.device("meta"):
        model = OuroForCausalLM(OuroConfig.from_file(tmp_path))
    state = model.state_dict()
    assert len(state) == 269
    assert sum(t.numel() for t in state.values()) == 1_434_652_673
    assert state["model.early_exit_gate.weight"].shape == (1, 2048)
    assert state["model.early_exit_gate.bias"].shape == (1,)
    assert not any("rotary" in k or "inv_freq" in k for k in state)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"use_sliding_window": True}, "sliding"),
    ],
)
def test_bad_configs_are_rejected(change, message):
    with pytest.raises(ConfigError, match=message):
        OuroConfig.from_dict({**OURO_14B_CONFIG, **change})


def test_missing_model_type_rejected():
    data = dict(OURO_14B_CONFIG)
    data.pop("model_type")
    with pytest.raises(ConfigError, match="model_type"):
        OuroConfig.from_dict(data)


def test_exit_distribution_matches_definition():
    lambdas = torch.tensor([[0.3, 0.5, 0.9, 0.2], [0.0, 0.0, 0.0, 0.0], [1.0, 0.4, 0.4, 0.4]], dtype=torch.float64)
    p = exit_distribution(lambdas)
    assert torch.allclose(p.sum(-1), torch.ones(3, dtype=torch.float64))
    for row in range(3):
        ref = reference_exit_cdf(lambdas[row].tolist())
        assert torch.allclose(exit_cdf(lambdas)[row], torch.tensor(ref, dtype=torch.float64), atol=1e-15)
        cdf, survive = torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
        for t in range(3):
            cdf, survive = cdf_step(cdf, survive, lambdas[row, t])
            assert abs(float(cdf) - ref[t]) < 1e-15
    assert p[1].tolist() == [0.0, 0.0, 0.0, 1.0]
