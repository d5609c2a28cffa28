"""Reward functions are plugins named by a dotted path: `f(response: str, label[, metadata]) -> float`.

`ouro train --reward-function PKG.MODULE.FUNC` imports the module and takes the
attribute (`PKG.MODULE:FUNC` and nested attributes `PKG.MODULE.CLASS.METHOD` work too).
The path, not the function object, is what the run plan records, so a resumed run
loads the same code. A reward takes the response text and the row's label, and may
take the row's `metadata` object (`{}` when the row has none) as a third positional
argument; `load_reward` looks at the signature once and returns a callable that is
always called as `fn(response, label, metadata)`. Three rewards ship here:

- `ouro_cli.rl.rewards.math_answer`: the DeepScaleR math grader, decision for decision
  (`math_grader.py`): MATH normalisation, then sympy equivalence, with DeepScaleR's
  `</think>` and `\\boxed{}` rules.
- `ouro_cli.rl.rewards.math_verify_answer`: Hugging Face's math-verify as a second
  grader (`math_verify_grader.py`; needs the `math` extra).
- `ouro_cli.rl.rewards.boxed_answer` (`ouro train`'s default, for the bundled arithmetic
  task): exact integer equality of the last `\\boxed{}` (`boxed.py`).

A plugin may define `f.check_label(label)` raising ValueError for a label it cannot
grade; `check_labels` runs it over a data set so that bad labels fail before any model
loads, naming file and line. Everything a bad path can do wrong is a `UserError` that
names the path; sympy is imported only when the math grader first grades.

What a reward returns must be a finite real number: a bool, an int or a float (NumPy's
real scalars included). Training and evaluation call a reward through a `Grader`
(grading.py), which stops on anything else, on a reward that raises, and on one that
runs past `--reward-timeout`, naming the function, the problem and the value.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ...errors import UserError
from ...plugins import resolve_callable
from .boxed import boxed_answer
from .grading import Grader, RewardFn, reward_problem
from .math_grader import math_answer
from .math_verify_grader import math_verify_answer

DEFAULT_REWARD = "ouro_cli.rl.rewards.math_answer"


def _takes_metadata(fn: Callable, path: str) -> bool:
    """Whether `fn` is called with the metadata: it can be called with three positional arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return False  # no signature available (some builtins): call it as f(response, label)
    for args in (("response", "label", "metadata"), ("response", "label")):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return len(args) == 3
    raise UserError(
        f"reward function {path!r} cannot be called as f(response, label) or "
        f"f(response, label, metadata): its signature is {signature}"
    )


def load_reward(path: str) -> RewardFn:
    """The reward named by `path` (`pkg.mod.func` or `pkg.mod:func`), as a callable of (response, label, metadata)."""
    fn = resolve_callable(path, what="reward function", example=DEFAULT_REWARD)
    if _takes_metadata(fn, path):
        return fn

    @functools.wraps(fn)  # keeps `check_label` and the name; `__wrapped__` is the plugin itself
    def reward(response: str, label: Any, metadata: Mapping[str, Any]) -> float:
        return fn(response, label)

    return reward


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


__all__ = [
    "DEFAULT_REWARD",
    "Grader",
    "RewardFn",
    "boxed_answer",
    "check_labels",
    "load_reward",
    "math_answer",
    "math_verify_answer",
    "reward_problem",
]
