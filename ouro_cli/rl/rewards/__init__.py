"""Reward functions are plugins named by a dotted path: `f(response: str, label) -> float`.

`ouro train --reward-function PKG.MODULE.FUNC` imports the module and takes the
attribute (`PKG.MODULE:FUNC` and nested attributes `PKG.MODULE.CLASS.METHOD` work too).
The path, not the function object, is what the run plan records, so a resumed run
loads the same code. Two rewards ship here:

- `ouro_cli.rl.rewards.math_answer` (default): DeepScaleR-style math grading, MATH
  normalisation plus sympy equivalence (`math_grader.py`).
- `ouro_cli.rl.rewards.boxed_answer`: exact integer equality of the last `\\boxed{}`
  (`boxed.py`).

A plugin may define `f.check_label(label)` raising ValueError for a label it cannot
grade; `check_labels` runs it over a data set so that bad labels fail before any model
loads, naming file and line. Everything a bad path can do wrong is a `UserError` that
names the path; sympy is imported only when the math grader first grades.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from ...errors import UserError
from .boxed import boxed_answer
from .math_grader import math_answer

RewardFn = Callable[[str, Any], float]
DEFAULT_REWARD = "ouro_cli.rl.rewards.math_answer"


def _import_longest_prefix(path: str) -> tuple[Any, list[str]]:
    """Import the longest importable module prefix of `path`; return it and the attribute names left."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only "this prefix does not exist" means try a shorter one; a module that
            # exists but fails to import one of *its* dependencies is a real error.
            if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                continue
            raise UserError(f"reward function {path!r}: importing {module_name!r} failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a broken plugin module, reported in one line
            raise UserError(f"reward function {path!r}: importing {module_name!r} failed: "
                            f"{type(exc).__name__}: {exc}") from exc
        return module, parts[cut:]
    raise UserError(f"reward function {path!r}: no module named {parts[0]!r}; give a dotted path "
                    f"such as {DEFAULT_REWARD}")


def load_reward(path: str) -> RewardFn:
    """The callable named by `path` (`pkg.mod.func` or `pkg.mod:func`), checked to take (response, label)."""
    if not isinstance(path, str) or not path.strip():
        raise UserError(f"reward function must be a dotted path such as {DEFAULT_REWARD}, got {path!r}")
    dotted = path.strip().replace(":", ".")
    if "." not in dotted or any(not part.isidentifier() for part in dotted.split(".")):
        raise UserError(f"reward function {path!r} is not a dotted path such as {DEFAULT_REWARD}")
    obj, attributes = _import_longest_prefix(dotted)
    for i, name in enumerate(attributes):
        if not hasattr(obj, name):
            owner = ".".join(dotted.split(".")[: len(dotted.split(".")) - len(attributes) + i])
            raise UserError(f"reward function {path!r}: {owner!r} has no attribute {name!r}")
        obj = getattr(obj, name)
    if not callable(obj):
        raise UserError(f"reward function {path!r} is not callable (it is a {type(obj).__name__}); name a function f(response, label)")
    try:
        inspect.signature(obj).bind("response", "label")
    except TypeError as exc:
        raise UserError(f"reward function {path!r} cannot be called as f(response, label): {exc}") from exc
    except ValueError:
        pass  # no signature available (some builtins): trust it
    return obj


def check_labels(fn: RewardFn, path: str, labels: Iterable[tuple[str, Any]]) -> None:
    """Run the plugin's optional `check_label` over (location, label) pairs, e.g. ("data.jsonl:7", 42)."""
    check = getattr(fn, "check_label", None)
    if check is None:
        return
    for where, label in labels:
        try:
            check(label)
        except (ValueError, TypeError) as exc:
            raise UserError(f"{where}: label {label!r} cannot be graded by {path}: {exc}") from exc


__all__ = ["DEFAULT_REWARD", "RewardFn", "boxed_answer", "check_labels", "load_reward", "math_answer"]
