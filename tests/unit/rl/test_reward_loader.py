"""Reward plugins by dotted path: the shipped ones load, every bad path is a one-line UserError naming it,
and whatever the plugin's arity, the loaded reward is called as fn(response, label, metadata)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl.rewards import (
    DEFAULT_REWARD,
    boxed_answer,
    check_labels,
    load_reward,
    math_answer,
    math_verify_answer,
)


@pytest.mark.parametrize(
    "path,fn",
    [
        ("ouro_cli.rl.rewards.boxed_answer", boxed_answer),
        ("ouro_cli.rl.rewards.boxed:boxed_answer", boxed_answer),
        ("ouro_cli.rl.rewards.math_answer", math_answer),
        (DEFAULT_REWARD, math_answer),
        pytest.param(
            "ouro_cli.rl.rewards.math_verify_answer",
            math_verify_answer,
            marks=pytest.mark.skipif(
                importlib.util.find_spec("math_verify") is None, reason="math-verify is not installed (the math extra)"
            ),
        ),
    ],
)
def test_shipped_rewards_load(path, fn):
    reward = load_reward(path)
    assert reward.__wrapped__ is fn
    assert reward.check_label is fn.check_label  # the label check travels with the reward
    assert reward("<think></think>\\boxed{7}", 7, {}) == fn("<think></think>\\boxed{7}", 7) == 1.0


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(
        "CONSTANT = 3\n"
        "def one_arg(response):\n    return 1.0\n"
        "def length(response, label):\n    return float(len(response))\n"
        "class Scorer:\n    @staticmethod\n    def score(response, label):\n        return 0.5\n"
        "def by_source(response, label, metadata):\n    return float(metadata.get('source') == label)\n"
        "def star(response, *rest):\n    return float(len(rest))\n"
        "def keyword_only(response, label, *, metadata=None):\n    return float(metadata is None)\n"
        "def four(response, label, metadata, extra):\n    return 1.0\n"
    )
    (tmp_path / "broken_plugin.py").write_text("import a_module_that_is_not_there\n")
    (tmp_path / "raising_plugin.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("myrewards", "broken_plugin", "raising_plugin"):
        sys.modules.pop(name, None)


def test_user_plugins(plugin_dir):
    assert load_reward("myrewards.length")("abc", None, {}) == 3.0
    assert load_reward("myrewards.Scorer.score")("abc", None, {}) == 0.5


def test_metadata_reaches_a_reward_that_takes_it(plugin_dir):
    reward = load_reward("myrewards.by_source")
    assert reward.__module__ == "myrewards" and not hasattr(reward, "__wrapped__")  # called as is
    assert reward("text", "aime", {"source": "aime"}) == 1.0
    assert reward("text", "aime", {}) == 0.0
    assert load_reward("myrewards.star")("text", 1, {}) == 2.0  # *args takes the metadata too
    assert load_reward("myrewards.keyword_only")("text", 1, {}) == 1.0  # metadata is positional only


@pytest.mark.parametrize(
    "path,message",
    [
        ("nonexistent_pkg_xyz.reward", "'nonexistent_pkg_xyz.reward': no module named 'nonexistent_pkg_xyz'"),
        ("ouro_cli.rl.rewards.no_such_reward", "'ouro_cli.rl.rewards' has no attribute 'no_such_reward'"),
        ("ouro_cli.rl.nope.reward", "'ouro_cli.rl' has no attribute 'nope'"),
        ("myrewards.CONSTANT", "is not callable (it is a int)"),
        ("myrewards.one_arg", "cannot be called as f(response, label) or f(response, label, metadata)"),
        ("myrewards.four", "its signature is (response, label, metadata, extra)"),
        ("myrewards.Scorer.nothing", "'myrewards.Scorer' has no attribute 'nothing'"),
        ("broken_plugin.reward", "importing 'broken_plugin' failed: No module named 'a_module_that_is_not_there'"),
        ("raising_plugin.reward", "importing 'raising_plugin' failed: RuntimeError: boom"),
        ("math_answer", "is not a dotted path"),
        ("a..b", "is not a dotted path"),
        ("", "must be a dotted path"),
    ],
)
def test_bad_paths(plugin_dir, path, message):
    with pytest.raises(UserError) as info:
        load_reward(path)
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text


def test_check_labels():
    check_labels(boxed_answer, "ouro_cli.rl.rewards.boxed_answer", [("d.jsonl:1", 5), ("d.jsonl:2", "7")])
    with pytest.raises(UserError, match=r"^d.jsonl:2: label 'x' cannot be graded by ouro_cli.rl.rewards.boxed_answer"):
        check_labels(boxed_answer, "ouro_cli.rl.rewards.boxed_answer", [("d.jsonl:1", 5), ("d.jsonl:2", "x")])
    check_labels(lambda r, label: 0.0, "custom.fn", [("d.jsonl:1", object())])  # no check_label: nothing to do


@pytest.mark.parametrize(
    "value, problem",
    [
        (None, "returned None (NoneType), not a number"),
        ("1.0", "returned '1.0' (str), not a number"),
        (float("nan"), "returned nan"),
        (float("-inf"), "returned -inf"),
        ([1.0], "returned [1.0] (list), not a number"),
        (complex(1, 0), "returned (1+0j) (complex), not a number"),
    ],
)
def test_a_reward_must_be_a_finite_real_number(value, problem):
    from ouro_cli.rl.rewards import reward_problem

    assert reward_problem(value) == problem


@pytest.mark.parametrize("value", [True, 0, 1, 0.5, -2.0])
def test_bools_ints_and_floats_are_rewards(value):
    import numpy as np

    from ouro_cli.rl.rewards import reward_problem

    assert reward_problem(value) is None
    assert reward_problem(np.float32(value)) is None


def test_numpy_arrays_and_complex_scalars_are_not_rewards():
    import numpy as np

    from ouro_cli.rl.rewards import reward_problem

    assert reward_problem(np.array([1.0, 2.0])) == "returned array([1., 2.]) (ndarray), not a number"
    assert reward_problem(np.array(1.0)) == "returned array(1.) (ndarray), not a number"
    assert reward_problem(np.complex64(1)) == f"returned {np.complex64(1)!r} (complex64), not a number"
    assert reward_problem(np.float64("nan")) == "returned nan"


@pytest.mark.parametrize("make", ["float32", "float64", "int64", "uint8", "bool_"])
def test_numpy_real_scalars_are_rewards(make):
    import numpy as np

    from ouro_cli.rl.rewards import reward_problem

    assert reward_problem(getattr(np, make)(1)) is None
