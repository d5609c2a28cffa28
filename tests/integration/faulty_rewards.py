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
