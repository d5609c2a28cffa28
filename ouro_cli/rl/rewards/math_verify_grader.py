"""`math_verify_answer`: Hugging Face's math-verify as a second math grader.

math-verify (PyPI `math-verify`; `pip install 'ouro-cli[math]'`) extracts the answer
itself (a `\\boxed{}`, a `$...$`, "the final answer is ..."), parses LaTeX and plain
expressions into sympy with its own normalisation, and compares values, sets,
intervals, equations and matrices. It is the grader behind open-r1's and lighteval's
math accuracy, so a number measured with it compares with theirs; `math_answer` is the
one that compares with DeepScaleR's. The two disagree by design: math-verify accepts an
unreduced `\\frac{2}{4}` for `\\frac{1}{2}`, DeepScaleR does not.

- Answer text: the response after its last `</think>`; one that opens `<think>` and
  never closes it has no answer (0); one without think tags is read whole (the rule of
  `boxed_answer`, `boxed.answer_region`).
- Label: as for `math_answer` (`label_answers`: a string, a number or a list of
  alternatives, `\\boxed{}` unwrapped). Each alternative is parsed as `\\boxed{label}`,
  as verl's math-verify reward does; any one may match.
- Parsing and comparison use math-verify's defaults, including its SIGALRM timeouts,
  which it can only set on the main thread; elsewhere it runs without them.
"""

from __future__ import annotations

import functools
import threading

from ...errors import UserError
from .boxed import answer_region
from .math_grader import label_answers


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise UserError(
            "math_verify_answer needs the math-verify package: "
            "pip install 'ouro-cli[math]' (or pip install math-verify)"
        ) from None
    return math_verify


def _timeout_s() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _gold(answer: str) -> tuple:
    mv = _math_verify()
    return tuple(mv.parse(f"\\boxed{{{answer}}}", parsing_timeout=_timeout_s()))


def math_verify_answer(response: str, label: object) -> float:
    """1.0 iff math-verify finds the response's answer equal to the label (see the module docstring)."""
    golds = [_gold(answer) for answer in label_answers(label)]
    region = answer_region(response)
    if region is None:
        return 0.0
    mv = _math_verify()
    parsed = mv.parse(region, parsing_timeout=_timeout_s())
    if not parsed:
        return 0.0
    return 1.0 if any(gold and mv.verify(list(gold), parsed, timeout_seconds=_timeout_s()) for gold in golds) else 0.0


def _check_label(label: object) -> None:
    _math_verify()  # a missing package fails here, before any model loads
    label_answers(label)


math_verify_answer.check_label = _check_label  # type: ignore[attr-defined]

__all__ = ["math_verify_answer"]
