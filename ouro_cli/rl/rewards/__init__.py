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

What a reward returns must be a finite real number (`reward_problem`): a bool, an int or
a float (numpy scalars included). None, a string (even "1.0"), NaN or inf would train
on garbage or poison the weights, so the loop stops on them (rl/loop.py score_stage).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

from ...errors import UserError
from ...plugins import resolve_callable
from .boxed import boxed_answer
from .math_grader import math_answer

RewardFn = Callable[[str, Any], float]
DEFAULT_REWARD = "ouro_cli.rl.rewards.math_answer"


def load_reward(path: str) -> RewardFn:
    """The callable named by `path` (`pkg.mod.func` or `pkg.mod:func`), checked to take (response, label)."""
    fn = resolve_callable(path, what="reward function", example=DEFAULT_REWARD)
    try:
        inspect.signature(fn).bind("response", "label")
    except TypeError as exc:
        raise UserError(f"reward function {path!r} cannot be called as f(response, label): {exc}") from exc
    except ValueError:
        pass  # no signature available (some builtins): trust it
    return fn


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


def reward_problem(value: Any) -> str | None:
    """Why `value` is not a usable reward (None when it is a finite real number)."""
    if not isinstance(value, numbers.Real):
        return f"returned {value!r} ({type(value).__name__}), not a number"
    if not math.isfinite(float(value)):
        return f"returned {float(value)}"
    return None


__all__ = ["DEFAULT_REWARD", "RewardFn", "boxed_answer", "check_labels", "load_reward", "math_answer",
           "reward_problem"]
