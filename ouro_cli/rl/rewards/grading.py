"""Calling a reward function: the one place a reward is computed, in training and in evaluation.

A reward must be a finite real number: a bool, an int or a float, NumPy's real scalars
included (`reward_problem`). None, a string, an array, a complex number, NaN or inf
would train on garbage or poison the weights, so a `Grader` stops on them, and on a
reward that raises or runs past `--reward-timeout` (time_limit.py), with one line
naming where it happened, the function, the `problem_id` and the value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import CheckFailed
from .time_limit import RewardTimeout, time_limit

RewardFn = Callable[[str, Any, Mapping[str, Any]], float]
MUST_BE = "a reward must be a finite real number (bool, int or float)"


def reward_problem(value: Any) -> str | None:
    """Why `value` is not a usable reward (None when it is a finite real number)."""
    if not (isinstance(value, numbers.Real) or _numpy_bool(value)):
        return f"returned {value!r} ({type(value).__name__}), not a number"
    if not math.isfinite(float(value)):
        return f"returned {float(value)}"
    return None


def _numpy_bool(value: Any) -> bool:
    """NumPy's bool, a real number that `numbers` does not register (its other real scalars it does)."""
    if type(value).__module__ != "numpy":
        return False
    import numpy

    return isinstance(value, numpy.bool_)


@dataclass(frozen=True)
class Grader:
    """A reward function called as `f(response, label, metadata)` (rewards/__init__.py
    `load_reward`), named by its dotted `path` in the line a failure prints, with an
    optional time limit per call in seconds."""

    fn: RewardFn
    path: str
    timeout: float | None = None

    @classmethod
    def of(cls, reward: Grader | RewardFn) -> Grader:
        """`reward` as a Grader (a bare function is named by its module and name)."""
        if isinstance(reward, Grader):
            return reward
        return cls(reward, f"{getattr(reward, '__module__', '?')}.{getattr(reward, '__qualname__', repr(reward))}")

    def __call__(self, response: str, label: Any, metadata: Mapping[str, Any], *, problem_id: Any, where: str) -> float:
        """The reward as a float, or CheckFailed: "`where`: reward function PATH <what went
        wrong> for problem_id ID; <what a reward must be>"."""
        try:
            with time_limit(self.timeout) as limit:
                value = self.fn(response, label, metadata)
        except RewardTimeout:
            problem = None
        except Exception as err:  # a plugin may raise anything
            problem = f"raised {type(err).__name__}: {err}"
        else:
            problem = reward_problem(value)
        if limit.fired:
            raise CheckFailed(
                f"{where}: reward function {self.path} took more than --reward-timeout "
                f"{self.timeout:g} s for problem_id {problem_id!r}; make it faster, or raise "
                "--reward-timeout"
            )
        if problem is not None:
            raise CheckFailed(
                f"{where}: reward function {self.path} {problem} for problem_id {problem_id!r}; {MUST_BE}"
            )
        return float(value)
