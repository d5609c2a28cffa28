"""The physical tensor names of an Ouro checkpoint, and the check that a stored set matches them.

Every format in ouro (Hugging Face safetensors, Megatron dist checkpoints, weight
publication to the engine) names tensors by their physical Hugging Face name
(`model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`, ...; docs/model.md §1). The
expected table is derived from the model itself, built on the meta device, so it can
never drift from `ouro_cli.model`: at Ouro-1.4B it has 269 tensors and 1,434,652,673
parameters, and allocates nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ouro_cli.errors import UserError
from ouro_cli.model.config import OuroConfig
from ouro_cli.model.meta_init import on_meta

# Added by training wrappers: DDP / Megatron's Float16Module (`module.`), multimodal
# or pipeline wrappers (`language_model.`). They may be nested, hence "repeatedly".
WRAPPER_PREFIXES = ("module.", "language_model.")


class CheckpointError(UserError):
    """A checkpoint on disk that cannot be used as it is (exit 2, one line)."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def strip_wrapper_prefixes(name: str) -> str:
    """`module.language_model.model.norm.weight` -> `model.norm.weight`."""
    while True:
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        else:
            return name


def expected_shapes(config: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Physical name -> shape for every stored tensor, in the model's state-dict order."""
    from ouro_cli.model.ouro import OuroForCausalLM

    with on_meta():
        model = OuroForCausalLM(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def parameter_count(shapes: Iterable[tuple[int, ...]]) -> int:
    return sum(TensorSpec(tuple(s), torch.uint8).numel for s in shapes)


def check_tensors(
    where: str,
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    *,
    allow_unexpected: bool = False,
) -> None:
    """Raise one CheckpointError naming every missing, unexpected and mis-shaped tensor."""
    missing = [n for n in expected if n not in found]
    unexpected = [] if allow_unexpected else sorted(n for n in found if n not in expected)
    misshaped = [
        f"{n} {list(found[n])} (expected {list(expected[n])})"
        for n in expected
        if n in found and tuple(found[n]) != tuple(expected[n])
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensors: {_first(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors: {_first(unexpected)}")
    if misshaped:
        problems.append(f"{len(misshaped)} tensors with the wrong shape: {_first(misshaped)}")
    if problems:
        raise CheckpointError(f"{where} does not match its config.json: " + "; ".join(problems))


def _first(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", and {len(items) - limit} more" if len(items) > limit else "")
