"""The `auto` options: defaults that follow the model.

`--lr`, `--max-response-len`, `--eval-prompts` and `ouro eval`'s `--prompts` default to
`auto`. For the bundled tiny model they take the bundled task's values; for any other
model, those of the shipped 1.4B recipe (examples/ouro-1.4b/recipe.toml, whose values a
test holds equal to `OURO_1_4B`). A value tuned for a 115k-parameter toy (lr 1e-4,
48-token answers) would otherwise apply silently to a real model.

"The bundled model" is a model whose config.json says `"ouro_defaults": "tiny"`
(model/config.py DEFAULTS_KEY): the bundled model's does, and so does every model built
from `model.tiny_config` (the test models). The key travels in the config through
conversion, training and export, so a copy or a run of the bundled model is still it, and
no public checkpoint carries it. A model whose config cannot be read is not the bundled
model (the command then fails on that model, naming it).

A command resolves `auto` once, before it starts, and records the value it chose (a run's
manifest and plan), so `ouro resume` reproduces it; `Choice.note` is the line the command
prints about it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

AUTO = "auto"
Auto = Literal["auto"]


@dataclass(frozen=True)
class Recipe:
    """The values `auto` stands for, for one kind of model."""

    source: str  # how a note names it
    lr: float
    max_response_len: int
    eval_prompts: int  # `ouro train`: held-out prompts per evaluation
    prompts: int  # `ouro eval`: prompts evaluated


TINY = Recipe("the bundled tiny task's", lr=1e-4, max_response_len=48, eval_prompts=200, prompts=64)
OURO_1_4B = Recipe("the 1.4B recipe's", lr=1e-6, max_response_len=2048, eval_prompts=500, prompts=500)


def number(value: float | int) -> str:
    """A value as the help and the notes write it: 1e-4, not 0.0001 or 1e-04."""
    if isinstance(value, int):
        return str(value)
    mantissa, _, exponent = f"{value:e}".partition("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    power = int(exponent)
    return f"{mantissa}e{power}" if abs(power) >= 4 else f"{value:g}"


def help_for(name: str) -> str:
    """What `auto` means for option `name`, for its help line."""
    return (
        f"auto: {number(getattr(TINY, name))} for the bundled tiny model, "
        f"{number(getattr(OURO_1_4B, name))} (examples/ouro-1.4b) for any other."
    )


def model_config(model: str | Path) -> dict[str, Any] | None:
    """The config.json of `model` (an HF directory, a Megatron checkpoint or a run directory,
    checkpoint/sources.py `assets_dir`), or None when it cannot be read."""
    from ouro_cli.checkpoint.sources import assets_dir

    try:
        data = json.loads((assets_dir(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def recipe_for(model: str | Path) -> Recipe:
    """TINY for the bundled model (module docstring), OURO_1_4B for any other."""
    from ouro_cli.model.config import DEFAULTS_KEY, TINY_DEFAULTS

    config = model_config(model)
    return TINY if config is not None and config.get(DEFAULTS_KEY) == TINY_DEFAULTS else OURO_1_4B


@dataclass(frozen=True)
class Choice:
    """One `auto` option and the value it resolved to."""

    flag: str
    value: float | int
    recipe: Recipe

    @property
    def note(self) -> str:
        return f"{self.flag} auto → {number(self.value)} ({self.recipe.source}; pass {self.flag} to choose)"


def choose(flag: str, value: Any, name: str, recipe: Recipe, chosen: list[Choice]) -> Any:
    """`value`, or when it is `auto` the recipe's value for option `name` (appended to `chosen`)."""
    if value != AUTO:
        return value
    resolved = getattr(recipe, name)
    chosen.append(Choice(flag, resolved, recipe))
    return resolved
