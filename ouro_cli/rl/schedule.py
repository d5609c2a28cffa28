"""The depth schedule, the execution-config hash, and the GRPO group check.

Depth schedule: update u decodes with budget `K = depths[u % len(depths)]`, every K
in 1..T (the model's `total_ut_steps`). It is a pure function of the update number,
so every rank and a resumed run agree on K without talking.

Execution-config hash: GRPO compares the samples of a group with each other, so they
must come from one execution: same prefill depth, decode budget, early-exit rule,
scheduling, speculation, sampling and log-probability mode. `execution_settings`
collects exactly those settings (`EXECUTION_KEYS`, all required) and `config_hash`
is the sha256 of their canonical JSON (sorted keys, no spaces; an integral float is
written as the integer, so `temperature=1` and `temperature=1.0` hash alike).

`validate_group` checks that one group has one prompt id, one K, one policy (weight)
version and one config hash, and names the field and the values that differ.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import UserError

EXECUTION_KEYS = (
    "prefill_depth",  # T: prompts always run every loop (docs/model.md §3)
    "max_loops",  # decode budget K of this update
    "min_loops",
    "exit_threshold",  # τ; 1.0 means exactly K loops
    "exit_mode",  # "immediate" | "delayed"
    "async_scheduling",
    "speculative_tokens",  # 0: no speculation
    "temperature",
    "top_p",
    "top_k",
    "logprobs_mode",  # "raw" | "processed"
)


def validate_depths(depths: Sequence[int], total_loops: int, flag: str = "--depths") -> list[int]:
    """The schedule `depths` (given by `flag`) checked against the model's T: non-empty, each K in 1..T."""
    if not depths:
        raise UserError(f"{flag} needs at least one decode depth K, e.g. {flag} 2 3 4")
    checked = []
    for k in depths:
        if isinstance(k, bool) or not isinstance(k, int):
            raise UserError(f"{flag}: {k!r} is not an integer loop count")
        if not 1 <= k <= total_loops:
            raise UserError(
                f"{flag}: K={k} is outside 1..{total_loops} (the model runs at most total_ut_steps={total_loops} loops)"
            )
        checked.append(k)
    return checked


def validate_min_loops(min_loops: int, total_loops: int) -> int:
    """--min-loops checked against the model's T: a token cannot run more loops than the model has."""
    if min_loops > total_loops:
        raise UserError(
            f"--min-loops {min_loops} is more than the model's total_ut_steps={total_loops} loops; "
            f"use at most {total_loops}"
        )
    return min_loops


def depth_for_update(depths: Sequence[int], update: int) -> int:
    """K of update number `update` (0-based): `depths[update % len(depths)]`."""
    if update < 0:
        raise ValueError(f"update number must be >= 0, got {update}")
    return depths[update % len(depths)]


def _canonical(value: Any, where: str) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"execution setting {where} is {value}, which has no canonical form")
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        return {str(k): _canonical(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"execution setting {where} is a {type(value).__name__}, not a JSON value")


def config_hash(settings: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of `settings`, which must hold every EXECUTION_KEYS entry."""
    missing = [k for k in EXECUTION_KEYS if k not in settings]
    if missing:
        raise ValueError(f"execution settings lack {', '.join(missing)}: the hash must cover every execution setting")
    canonical = {str(k): _canonical(v, str(k)) for k, v in settings.items()}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def execution_settings(
    params: Any, *, prefill_depth: int, async_scheduling: bool = False, speculative_tokens: int = 0
) -> dict[str, Any]:
    """The EXECUTION_KEYS of one request: sampling/depth fields read from resolved `params`
    (an engine `SamplingParams`, or anything with those attributes), the rest given."""
    if getattr(params, "max_loops", None) is None:
        raise ValueError("execution settings need resolved params (max_loops set to the update's K)")
    return {
        "prefill_depth": prefill_depth,
        "max_loops": params.max_loops,
        "min_loops": params.min_loops,
        "exit_threshold": params.exit_threshold,
        "exit_mode": params.exit_mode,
        "async_scheduling": async_scheduling,
        "speculative_tokens": speculative_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "logprobs_mode": params.logprobs_mode,
    }


class GroupMismatch(ValueError):
    """A GRPO group whose samples do not come from one prompt and one execution."""


_GROUP_FIELDS = {
    "prompt id": ("prompt_id",),
    "K": ("k", "max_loops"),
    "policy version": ("weight_version", "policy_version"),
    "config hash": ("config_hash",),
}


def _field(sample: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        if isinstance(sample, Mapping):
            if name in sample:
                return sample[name]
        elif hasattr(sample, name):
            return getattr(sample, name)
    if names[0] == "k":  # an engine RequestOutput keeps K in its effective sampling params
        params = (
            sample.get("sampling_params") if isinstance(sample, Mapping) else getattr(sample, "sampling_params", None)
        )
        if params is not None and getattr(params, "max_loops", None) is not None:
            return params.max_loops
    raise GroupMismatch(f"group sample has no {' or '.join(names)} field")


def validate_group(outputs: Sequence[Any]) -> None:
    """Check one GRPO group: one prompt id, one K, one policy version, one config hash.

    Each sample is a mapping or object with `prompt_id`, `k` (or `max_loops`, or
    `sampling_params.max_loops`), `weight_version` and `config_hash`.
    """
    if not outputs:
        raise GroupMismatch("empty GRPO group")
    for what, names in _GROUP_FIELDS.items():
        values = [_field(o, names) for o in outputs]
        distinct = list(dict.fromkeys(map(repr, values)))
        if len(distinct) > 1:
            first = values[0]
            bad = next(i for i, v in enumerate(values) if repr(v) != repr(first))
            raise GroupMismatch(
                f"GRPO group mixes {what}s: sample 0 has {first!r}, sample {bad} has {values[bad]!r} "
                f"({len(distinct)} distinct values in {len(values)} samples)"
            )


__all__ = [
    "EXECUTION_KEYS",
    "GroupMismatch",
    "config_hash",
    "depth_for_update",
    "execution_settings",
    "validate_depths",
    "validate_group",
    "validate_min_loops",
]
