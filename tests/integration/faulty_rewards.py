"""Reward plugins that break the reward contract, one way each (tests/integration/test_failures.py)."""

from __future__ import annotations


def nan_reward(response: str, label) -> float:
    return float("nan")


def string_reward(response: str, label):
    return "1.0"


def none_reward(response: str, label):
    return None


def raising_reward(response: str, label) -> float:
    raise ZeroDivisionError("no digits to count")


def array_reward(response: str, label):
    import numpy as np

    return np.array([1.0, 2.0])


def complex_reward(response: str, label):
    return complex(1, 0)


def numpy_bool_reward(response: str, label):
    import numpy as np

    return np.bool_(any(c.isdigit() for c in response))


def slow_reward(response: str, label) -> float:
    import time

    time.sleep(60)
    return 0.0
