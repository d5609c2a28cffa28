"""Calling a reward (ouro_cli.rl.rewards.grading, time_limit): the one line a failure prints,
and `--reward-timeout`, which stops a slow call and touches no reward that comes in time."""

from __future__ import annotations

import signal
import time

import pytest

from ouro_cli.errors import CheckFailed
from ouro_cli.rl.rewards import Grader
from ouro_cli.rl.rewards.time_limit import SIGNAL, RewardTimeout


def sleeps(response, label, metadata):
    time.sleep(30)
    return 1.0


def swallows(response, label, metadata):
    """A reward that takes everything, the limit included, and answers anyway."""
    try:
        time.sleep(30)
    except BaseException:  # noqa: BLE001
        pass
    return 1.0


def spins(response, label, metadata):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pass
    return 1.0


@pytest.mark.parametrize("fn", [sleeps, swallows, spins])
def test_a_call_past_the_timeout_stops_at_once_and_names_the_function(fn):
    handler = signal.getsignal(SIGNAL)
    start = time.monotonic()
    with pytest.raises(CheckFailed) as err:
        Grader(fn, "my.rewards.slow", timeout=0.2)("x", 1, {}, problem_id="p7", where="update 3")
    assert time.monotonic() - start < 5
    assert str(err.value) == (
        "update 3: reward function my.rewards.slow took more than --reward-timeout 0.2 s for "
        "problem_id 'p7'; make it faster, or raise --reward-timeout"
    )
    assert signal.getsignal(SIGNAL) is handler


def test_a_call_in_time_is_untouched_and_a_late_signal_raises_nothing():
    grade = Grader(lambda r, label, m: len(r), "my.rewards.length", timeout=0.05)
    assert [grade("abc", 1, {}, problem_id=i, where="update 0") for i in range(50)] == [3.0] * 50
    time.sleep(0.2)  # every watchdog has ended: nothing fires after its call


def test_a_time_limit_exception_is_not_an_exception():
    assert issubclass(RewardTimeout, BaseException) and not issubclass(RewardTimeout, Exception)


@pytest.mark.parametrize(
    "value, shown",
    [
        ("1", "returned '1' (str), not a number"),
        (complex(1, 0), "returned (1+0j) (complex), not a number"),
        (float("inf"), "returned inf"),
    ],
)
def test_a_value_that_is_not_a_finite_real_number_is_one_line(value, shown):
    with pytest.raises(CheckFailed) as err:
        Grader(lambda r, label, m: value, "my.rewards.odd")("x", 1, {}, problem_id=4, where="evaluation, K=2")
    assert str(err.value) == (
        f"evaluation, K=2: reward function my.rewards.odd {shown} for problem_id 4; "
        "a reward must be a finite real number (bool, int or float)"
    )


def test_numpy_real_scalars_are_floats():
    import numpy as np

    for value in (np.bool_(True), np.int64(1), np.float32(1.0)):
        got = Grader(lambda r, label, m, v=value: v, "my.rewards.np")("x", 1, {}, problem_id=0, where="update 0")
        assert got == 1.0 and type(got) is float
