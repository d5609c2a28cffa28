"""`OuroConfig` for transformers: the model's config.json as a `PretrainedConfig`.

Its keys and their defaults are those of `ouro_cli.model.OuroConfig` (Ouro-1.4B's values), which
stays the one place they are defined and checked: `to_ouro()` hands the keys our model
interprets over to it, and every other key of config.json rides along as an attribute, as
transformers keeps unknown keys.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from transformers import PretrainedConfig

from ouro_cli import model as ouro_model

# The keys our model interprets (`extra` holds the others; model_type is the class's).
OURO_KEYS = tuple(f.name for f in fields(ouro_model.OuroConfig) if f.name not in ("extra", "model_type"))


class OuroConfig(PretrainedConfig):
    """An Ouro config.json as transformers reads and writes it; `to_ouro()` is our model's config."""

    model_type = "ouro"

    def __init__(self, **kwargs: Any) -> None:
        defaults = {k: v for k, v in ouro_model.OuroConfig().to_dict().items() if k in OURO_KEYS}
        given = {**defaults, **kwargs}
        if given.get("rope_scaling") is None:  # none is the default; transformers 5 warns on the key itself
            given.pop("rope_scaling", None)
        super().__init__(**given)

    def to_ouro(self) -> ouro_model.OuroConfig:
        """Our model's config of the same keys (a ConfigError where our model cannot run them)."""
        ours = {k: getattr(self, k) for k in OURO_KEYS if hasattr(self, k)}
        return ouro_model.OuroConfig.from_dict({**ours, "model_type": "ouro"})
