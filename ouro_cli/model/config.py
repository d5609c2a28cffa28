"""`OuroConfig`: the model's `config.json`, typed, with unknown keys preserved.

The public checkpoints carry keys we do not interpret (auto_map, torch_dtype,
transformers_version, ...). They are kept verbatim in `extra` and written back,
so a converted or exported checkpoint still loads with the original remote code.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

# A key of config.json that says "the `auto` options take the bundled task's values for me"
# (ouro_cli/defaults.py): the bundled tiny model carries it, as does every model built from
# `tiny_config`; it travels in `extra` through conversion, training and export.
DEFAULTS_KEY, TINY_DEFAULTS = "ouro_defaults", "tiny"


class ConfigError(ValueError):
    """A config.json that is not an Ouro model config we can run."""


@dataclass
class OuroConfig:
    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 65536
    tie_word_embeddings: bool = False
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    pad_token_id: int | None = 0
    sliding_window: int | None = None
    use_sliding_window: bool = False
    model_type: str = "ouro"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def num_loops(self) -> int:
        """T: how many times the shared layers are applied at full depth."""
        return self.total_ut_steps

    def validate(self) -> None:
        if self.model_type != "ouro":
            raise ConfigError(f"model_type is {self.model_type!r}, expected 'ouro'")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError("hidden_size must be divisible by num_attention_heads")
        if self.dim_per_head % 2:
            raise ConfigError("head_dim must be even for rotary embeddings")
        if self.total_ut_steps < 1:
            raise ConfigError("total_ut_steps must be at least 1")
        if (
            self.rope_scaling not in (None, {})
            and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) != "default"
        ):
            raise ConfigError(f"rope_scaling {self.rope_scaling!r} is not supported (default RoPE only)")
        if self.use_sliding_window:
            raise ConfigError("sliding-window attention is not supported")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings=true is not supported (Ouro ships an untied lm_head)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OuroConfig:
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        if "model_type" not in data:
            raise ConfigError("config.json has no model_type (expected 'ouro')")
        try:
            return cls(**kwargs, extra=extra)
        except TypeError as err:  # pragma: no cover - defensive
            raise ConfigError(str(err)) from err

    @classmethod
    def from_file(cls, path: str | Path) -> OuroConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as err:
            raise ConfigError(f"{path} does not exist") from err
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        extra = data.pop("extra")
        if data["head_dim"] is None:
            data.pop("head_dim")
        return {**data, **extra}

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path


def tiny_config(**overrides: Any) -> OuroConfig:
    """A few-layer Ouro for tests and demos (T = 4 loops, GQA on), marked as one whose `auto`
    options take the bundled task's values (DEFAULTS_KEY)."""
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        extra={
            "architectures": ["OuroForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_ouro.OuroConfig",
                "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
            },
            "torch_dtype": "float32",
            DEFAULTS_KEY: TINY_DEFAULTS,
        },
    )
    base.update(overrides)
    return OuroConfig(**base)
