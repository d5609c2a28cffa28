"""Load an engine factory from a dotted path (`ouro train --engine DOTTED.PATH`).

A factory is any callable `factory(model, **engine_options) -> engine` where `model`
is a checkpoint path (or a loaded OuroForCausalLM, for in-process engines) and the
engine satisfies `contract.RolloutEngine`. Both `pkg.mod:attr` and `pkg.mod.attr`
are accepted. The built-in one is `ouro_cli.engine.factory:default_factory`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ouro_cli.errors import UserError
from ouro_cli.plugins import resolve_callable

from .contract import RolloutEngine

DEFAULT_FACTORY = "ouro_cli.engine.factory:default_factory"

EngineFactory = Callable[..., RolloutEngine]


def default_factory(model: Any, **options: Any) -> RolloutEngine:
    from .engine import LLM

    return LLM(model, **options)


def load_factory(dotted: str) -> EngineFactory:
    """The callable named by `dotted`, or a UserError saying what is wrong with the path."""
    return resolve_callable(dotted, what="--engine", example=DEFAULT_FACTORY)


def make_engine(dotted: str, model: Any, **options: Any) -> RolloutEngine:
    """Build an engine with the factory at `dotted` and check it satisfies the contract."""
    engine = load_factory(dotted)(model, **options)
    if not isinstance(engine, RolloutEngine):
        missing = [m for m in _CONTRACT_METHODS if not callable(getattr(engine, m, None))]
        raise UserError(
            f"--engine {dotted!r} returned a {type(engine).__name__} that does not implement the "
            f"rollout-engine contract (missing: {', '.join(missing)})"
        )
    return engine


_CONTRACT_METHODS = (
    "generate",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "get_weight_version",
    "pause_generation",
    "resume_generation",
    "work_counters",
    "close",
)
