"""`math_verify_answer`: math-verify behind our answer region and labels; skipped without math-verify.

Expected values are math-verify's own decisions (its documented leniency: values, not
forms), where they differ from DeepScaleR's `math_answer` that is said.
"""

from __future__ import annotations

import importlib.util
import sys
import threading

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl.rewards import math_answer, math_verify_answer, math_verify_grader

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None,
    reason="math-verify is not installed (pip install 'ouro-cli[math]')",
)


def box(answer: str) -> str:
    return f"<think>\nworking\n</think>\nSo the answer is $\\boxed{{{answer}}}$."


@needs_math_verify
@pytest.mark.parametrize(
    "response,label,expected",
    [
        (box("\\frac{1}{2}"), "0.5", 1.0),
        (box("\\frac{2}{4}"), "\\frac{1}{2}", 1.0),  # math_answer: 0 (unreduced)
        (box("2^2"), "4", 1.0),  # math_answer: 0 (an integer must be one)
        (box("(1,2]"), "(1,2]", 1.0),
        (box("(1,2)"), "(1,2]", 0.0),
        (box("3"), 4, 0.0),
        (box("7"), ["\\boxed{3}", 7], 1.0),
        ("The answer is $\\boxed{5}$.", 5, 1.0),  # no think tags: read whole (math_answer: 0)
        ("<think>\nso \\boxed{5}", 5, 0.0),  # cut off while thinking
        ("<think>\\boxed{5}</think>I do not know.", 5, 0.0),
    ],
)
def test_math_verify_answer(response, label, expected):
    assert math_verify_answer(response, label) == expected


@needs_math_verify
def test_it_is_a_second_opinion_not_deepscaler():
    assert math_verify_answer(box("\\frac{2}{4}"), "\\frac{1}{2}") != math_answer(box("\\frac{2}{4}"), "\\frac{1}{2}")


@needs_math_verify
def test_works_off_the_main_thread():
    results = []
    worker = threading.Thread(target=lambda: results.append(math_verify_answer(box("0.25"), "\\frac14")))
    worker.start()
    worker.join(60)
    assert results == [1.0]


@needs_math_verify
@pytest.mark.parametrize("label", [None, True, [], "  "])
def test_bad_labels_are_refused(label):
    with pytest.raises(ValueError):
        math_verify_answer.check_label(label)


def test_missing_package_is_one_line(monkeypatch):
    math_verify_grader._math_verify.cache_clear()
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails as if not installed
    try:
        with pytest.raises(UserError) as info:
            math_verify_answer.check_label("1")
        assert str(info.value) == (
            "math_verify_answer needs the math-verify package: "
            "pip install 'ouro-cli[math]' (or pip install math-verify)"
        )
    finally:
        math_verify_grader._math_verify.cache_clear()
