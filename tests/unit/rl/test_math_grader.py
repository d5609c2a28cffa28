"""`math_answer` makes DeepScaleR's decision on every case of a differential corpus.

`deepscaler_cases.jsonl` holds (rule, response, label, expected) cases. Each expected
value is what DeepScaleR's grader decides (its `RewardMathFn` as `rllm` keeps it, over
`agentica-project/deepscaler:deepscaler/rewards/math_utils/utils.py`): derived by reading that code, and confirmed by
running it in a
scratch environment outside this repository (sympy 1.14, pylatexenc 2.10 and 2.11 gave
the same decisions). `rule` names the rule of `math_grader.py` that a case exercises;
both correct and incorrect outcomes are there for every rule, including the ones where
DeepScaleR deliberately says "not equal" (unreduced fractions, integers written as
expressions, element order in sets).

The rest checks what this grader adds on purpose: inputs that DeepScaleR would hand
to Python's eval and then hang or run out of memory on are refused quickly, a slow
sympy step times out as "not equal", and bad labels are refused up front.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from ouro_cli.rl.rewards import math_answer, math_grader
from ouro_cli.rl.rewards.math_grader import (
    extract_boxed,
    final_answer,
    grade_answer,
    hendrycks_normalize,
    label_answers,
    sympy_normalize,
)

CORPUS = [json.loads(line) for line in (Path(__file__).parent / "deepscaler_cases.jsonl").read_text().splitlines()]
RULES = {
    "think-gate",
    "last-box",
    "label-number",
    "label-boxed",
    "label-list",
    "hendrycks-text",
    "hendrycks-give-up",
    "frac-forms",
    "sqrt-forms",
    "unreduced-fraction",
    "integer-strict",
    "decimal",
    "leading-zero",
    "sign",
    "spacing",
    "units",
    "degrees",
    "percent",
    "money",
    "thousands",
    "equation-lhs",
    "tuple",
    "interval",
    "set",
    "symbolic",
    "constants",
    "mixed-number",
    "matrix",
    "latex-misc",
}


def box(answer: str) -> str:
    return f"<think>\nworking\n</think>\nSo the answer is $\\boxed{{{answer}}}$."


@pytest.mark.parametrize("case", CORPUS, ids=[f"{i}-{c['rule']}" for i, c in enumerate(CORPUS)])
def test_agrees_with_deepscaler(case):
    start = time.process_time()  # this process's CPU time: no pathological sympy case, whatever else runs
    assert math_answer(case["response"], case["label"]) == case["expected"], case
    assert time.process_time() - start < 3.0


def test_corpus_covers_every_rule_both_ways():
    assert len(CORPUS) >= 200
    assert {c["rule"] for c in CORPUS} == RULES
    correct = Counter(c["rule"] for c in CORPUS if c["expected"] == 1.0)
    wrong = Counter(c["rule"] for c in CORPUS if c["expected"] == 0.0)
    assert all(correct[r] and wrong[r] for r in RULES), (correct, wrong)


def test_extraction():
    assert extract_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{1} \\boxed{2") is None  # an unclosed last box is no answer
    assert extract_boxed("\\boxed {1}") is None
    assert extract_boxed("\\fbox{1}") is None
    assert final_answer("\\boxed{1}") is None  # no </think>
    assert final_answer("<think>a</think>\\boxed{1}</think>\\boxed{2}") == "1"  # between the first two


def test_normalisation_examples():
    assert hendrycks_normalize(" \\text{ x = \\dfrac12 } ") == "\\frac{1}{2}"
    assert hendrycks_normalize("5\\text{ cm}") == "5"
    assert hendrycks_normalize("3/4") == "\\frac{3}{4}"
    assert hendrycks_normalize("\\sqrt") == "\\sqrt"  # gives up: compared as written
    assert sympy_normalize("\\frac{1}{2}") == "1/2"
    assert sympy_normalize("1,000 meters^2") == "1000"
    assert sympy_normalize("2.99999999") == "3"
    assert sympy_normalize("\\text{Yes}") == "yes"


def test_label_answers():
    assert label_answers(5) == ["5"]
    assert label_answers(1e-05) == ["1e-05"]
    assert label_answers(["\\boxed{3}", 4]) == ["3", "4"]


@pytest.mark.parametrize("label", [None, True, [], [[1]], {"answer": 1}, "  ", "\\boxed{1", ["1", "\\boxed{"]])
def test_bad_labels_are_refused(label):
    with pytest.raises(ValueError):
        math_answer.check_label(label)


# ---- where this grader departs from DeepScaleR on purpose: it will not hang ----------


@pytest.mark.parametrize(
    "given,truth",
    [
        ("x+9**9**9", "x"),  # DeepScaleR evaluates 9^387420489
        ("x+(9**9)!", "x"),  # a factorial of a power
        ("x+99999!", "x"),  # a factorial of a large literal
        ("x+[1]*10**10", "x"),  # a list of 10^10 elements
        ("x+(1,)*10**9", "x"),  # a tuple of 10^9
        ("eye(10**5)", "0.5"),  # a 10^10-entry matrix
        ("ff(10**6,10**6)", "x"),  # a million-term product
        ("0.5*(1).__eq__(1)", "0.5"),  # attribute access
        ("(0.5)or(1)", "0.5"),  # a keyword: more than arithmetic
    ],
)
def test_dangerous_answers_are_refused_quickly(given, truth):
    # DeepScaleR's own rules would hand each of these to sympy's parse_expr (Python's eval).
    assert math_grader._sympy_may_try(f"({sympy_normalize(truth)})-({sympy_normalize(given)})")
    grade_answer.cache_clear()
    start = time.perf_counter()
    assert math_answer(box(given), truth) == 0.0
    assert time.perf_counter() - start < 2.0


def test_floor_division_is_refused():
    # pylatexenc reads this malformed box as `1//2+1/2`; DeepScaleR evaluates that to 1/2 (1.0).
    assert sympy_normalize("\\dfrac1/2\\!\\dfrac12") == "1//2+1/2"
    assert math_answer(box("\\dfrac1/2\\!\\dfrac12"), "1/2") == 0.0


def test_arithmetic_it_does_evaluate():
    assert math_answer(box("x+2**3"), "x+8") == 1.0
    assert math_answer(box("5!x"), "120x") == 1.0
    assert math_answer(box("0.[3]x"), "x/3") == 1.0  # sympy's repeated-decimal notation


def test_slow_sympy_step_times_out_as_not_equal(monkeypatch):
    import sympy

    def slow(expr):
        while True:
            pass

    monkeypatch.setattr(sympy, "simplify", slow)
    monkeypatch.setattr(math_grader, "TIME_BUDGET_S", 0.2)
    grade_answer.cache_clear()
    start = time.perf_counter()
    assert not grade_answer("x^2+2x+1", "(x+1)^2")
    assert time.perf_counter() - start < 2.0
    grade_answer.cache_clear()


def test_time_budget_interrupts_a_slow_step():
    start = time.perf_counter()
    with pytest.raises(math_grader._Timeout):
        with math_grader.time_budget(0.2):
            while True:
                pass
    assert time.perf_counter() - start < 2.0


def test_works_off_the_main_thread():
    grade_answer.cache_clear()
    results = []
    worker = threading.Thread(
        target=lambda: results.append(math_answer(box("\\frac{1}{\\sqrt{3}}"), "\\frac{\\sqrt3}{3}"))
    )
    worker.start()
    worker.join(30)
    assert results == [1.0]
