"""`math_answer`: the DeepScaleR math grader, decision for decision.

GRPO results on math are compared against DeepScaleR's reward
(`agentica-project/deepscaler:deepscaler/rewards/math_reward.py` over
`agentica-project/deepscaler:deepscaler/rewards/math_utils/utils.py`; their `rllm`
repository keeps the same grader). A reward that is merely "DeepScaleR-style" shifts every
accuracy it touches, so this module reimplements that grader's rules exactly,
including the ones that look like mistakes; `tests/unit/rl/deepscaler_cases.jsonl`
holds the cases (each tagged with its rule) on which the two are checked to agree.
Score 1.0 when DeepScaleR would call the response correct, else 0.0.

**Which text is the answer.**
- The response must contain `</think>`; the solution is the text between the first
  `</think>` and the next one (or the end). No `</think>`: 0.
- The answer is the last `\\boxed` of the solution: from that `\\boxed`, braces are
  counted (an escaped `\\{` counts like any other brace) up to the `}` that brings the
  count back to zero, and the text must begin `\\boxed{`. So `\\boxed {5}`, `\\boxed 5`
  and an unclosed last box have no answer (0), and an earlier box is never used
  instead; `\\fbox` is not an answer.
- Labels: a string, number, or a list of them (any one may match). A number is
  graded as Python prints it (`0.5`, `1e-05`); a label containing `\\boxed` is replaced
  by its boxed content. Where DeepScaleR would quietly grade a bad label (a box that
  does not close, a blank answer, a boolean) as never matched, `check_label` refuses
  it before training starts.

**Two tests; either one accepts** (`grade_answer`).
1. *Hendrycks' MATH rule* (`hendrycks_normalize`, then string equality). Trim; a
   whole-answer `\\text{...}` is unwrapped; then: line breaks and `\\!` go; `\\\\`
   becomes `\\`; `tfrac`/`dfrac` become `frac`; `\\left`/`\\right` go; `^{\\circ}`/`^\\circ`
   go; `\\$` goes; units: everything from a `\\text{ ` (brace, then a space) on goes;
   `\\%` goes (a bare `%` stays); ` .` and `{.` and a leading `.` get their `0`; a left
   side of at most two characters before a single `=` goes (`x = 5`, `k=5`); `\\sqrt3`
   becomes `\\sqrt{3}`; spaces go; `\\frac12` becomes `\\frac{1}{2}` and `\\frac1{72}`
   `\\frac{1}{72}`; exactly `0.5` becomes `\\frac{1}{2}`; an integer ratio written
   canonically (`3/4`, `-1/2`) becomes `\\frac{3}{4}`. If the answer has two
   `\\text{ ` units, or ends in a bare `\\sqrt` or `\\frac`, normalising gives up and
   the trimmed, unwrapped answer is compared as it is.
2. *The sympy rule* (`sympy_normalize`, then elements). Normalising: a whole-answer
   `\\text{...}` is unwrapped; `$` and `%` go (escaped or not); ` or ` and ` and `
   become commas; `million`/`billion`/`trillion` become `*10^6`/`^9`/`^12`; the unit
   words degree, cm, centimeter, meter, mile, second, minute, hour, day, week, month,
   year, foot, feet, inch, yard go wherever they occur (with a plural `s`/`es`,
   trailing spaces and a `^2`); `^\\circ` goes; one pair of outer braces goes; `,\\!`
   thousands separators go; a number within 1e-7 of an integer becomes that integer;
   anything with a backslash goes through pylatexenc's LaTeX-to-text (`\\frac{1}{2}`
   -> `1/2`, `\\sqrt{3}` -> `sqrt(3)`, `\\pi` -> `pi`, `\\infty` -> `inf`); `- ` loses
   its space; digits separated by spaces are a mixed number (`7 3/4` -> `7+3/4`);
   spaces and braces go; lower case; a number within 1e-7 of an integer is cut to
   that integer (`2.99999999` becomes `2` when it gets here, `3` when it was a plain
   number at the start). Then: equal strings are equal answers. Otherwise both are
   split into elements when they are one `(...)` or `[...]` group with no brackets
   inside (`(1,2]`; commas inside a number, `1,000`, are not separators); element
   lists must have the same length and, for more than one element, the same first and
   last characters (so `(1,2)` is not `[1,2)`, and a set or `1,2` without brackets
   is one element, compared as a whole). Element by element: two fractions of
   integers (`2/4`, `1/2`) must be the same string -- unreduced is wrong; an integer
   is never equal to a non-integer form (`4` is not `2^2`, `8/2` or `\\sqrt{16}`);
   otherwise sympy decides: `simplify((truth) - (given)) == 0`, tried only when the
   two together use at most two distinct letters (besides `sqrt` and `frac`) and have
   no `^(`, `^{`, chained `^` or multi-digit exponent.

Safety, the one place where the decision departs from DeepScaleR on purpose.
DeepScaleR hands that last step to sympy's `parse_expr`, which is Python's `eval`, with
no time limit: `9**9**9` or `(9**9)!` in a box would stall training for hours, and
`[1]*10**10` would exhaust memory. Here the text first has to tokenise to numbers, the
operators `+ - * / ** ( ) [ ] ,` and `!` (after a name or a number up to 1000), and
names that are not keywords, do not start with `_`, and are not sympy or builtin
callables other than a few harmless ones (`sqrt`, `pi`, `ln`...). It is then parsed
unevaluated and refused if it holds a tuple or a number of more than `MAX_DIGITS`
digits. Only then is it evaluated and simplified, under a wall-clock budget
(`TIME_BUDGET_S`, SIGALRM, where the calling thread can use it). A refusal or a
timeout is "not equal". Besides the hazards, this refuses Python's floor division
`//`, attribute access and keywords, which DeepScaleR evaluates: pylatexenc turns a
malformed `\\frac1/2` into `1//2`, and DeepScaleR then finds `1//2+1/2` equal to `1/2`;
this grader does not.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import io
import keyword
import logging
import math
import re
import signal
import threading
import tokenize
import types
import warnings
from collections.abc import Iterator

THINK_END = "</think>"
TIME_BUDGET_S = 5.0
MAX_DIGITS = 20_000

# ---------------------------------------------------------------------------------------
# which text is the answer


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` of `text` under DeepScaleR's rule (module docstring)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                span = text[start : i + 1]
                return span[len("\\boxed{") : -1] if span.startswith("\\boxed{") else None
    return None


def final_answer(response: str) -> str | None:
    """The boxed answer of the solution that follows the first `</think>` (None: no answer)."""
    first = response.find(THINK_END)
    if first < 0:
        return None
    solution = response[first + len(THINK_END) :]
    second = solution.find(THINK_END)
    return extract_boxed(solution if second < 0 else solution[:second])


def label_answers(label: object) -> list[str]:
    """The answers a label accepts, as strings (see the module docstring); ValueError for a label
    that is not a string, a number or a non-empty list of them, or that holds no answer."""
    items = label if isinstance(label, list) else [label]
    if not items:
        raise ValueError("a math label needs at least one answer, got an empty list")
    answers = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise ValueError(f"a math label is a string, a number or a list of them, got {item!r}")
        text = str(item)
        if "\\boxed" in text:
            boxed = extract_boxed(text)
            if boxed is None:
                raise ValueError(f"label {text!r} has a \\boxed that does not close")
            text = boxed
        if not text.strip():
            raise ValueError("a math label must not be blank")
        answers.append(text)
    return answers


# ---------------------------------------------------------------------------------------
# 1. Hendrycks' MATH rule

_WHOLE_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")


class _GiveUp(Exception):
    """Normalisation met a form it cannot rewrite; the answer is compared unnormalised."""


def _braced_sqrt_arguments(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    head, *pieces = s.split("\\sqrt")
    out = [head]
    for piece in pieces:
        if not piece:
            raise _GiveUp("\\sqrt without an argument")
        out.append("\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:])
    return "".join(out)


def _braced_frac_arguments(s: str) -> str:
    head, *pieces = s.split("\\frac")
    out = [head]
    for piece in pieces:
        if not piece:
            raise _GiveUp("\\frac without arguments")
        if piece[0] == "{":
            out.append("\\frac" + piece)
        elif len(piece) < 2:
            return s  # `\frac1` at the end: the fraction fix is skipped, the rest goes on
        elif piece[1] == "{":
            out.append("\\frac{" + piece[0] + "}" + piece[1:])
        else:
            out.append("\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:])
    return "".join(out)


def _is_canonical_int(text: str) -> bool:
    try:
        return str(int(text)) == text
    except ValueError:  # not an integer, or beyond Python's 4300-digit conversion limit
        return False


def _hendrycks_rewrite(s: str) -> str:
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    if "\\text{ " in s:
        units = s.split("\\text{ ")
        if len(units) != 2:
            raise _GiveUp("more than one unit")
        s = units[0]
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = _braced_sqrt_arguments(s)
    s = s.replace(" ", "")
    s = _braced_frac_arguments(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    if s.count("/") == 1:
        a, b = s.split("/")
        if _is_canonical_int(a) and _is_canonical_int(b):
            s = "\\frac{" + a + "}{" + b + "}"
    return s


def hendrycks_normalize(answer: str) -> str:
    """The MATH (Hendrycks) canonical string of an answer, as DeepScaleR computes it."""
    answer = answer.strip()
    whole = _WHOLE_TEXT.search(answer)
    if whole is not None:
        answer = whole.group("text").strip()
    try:
        return _hendrycks_rewrite(answer)
    except _GiveUp:
        return answer


# ---------------------------------------------------------------------------------------
# 2. the sympy rule: normalisation

_UNIT_WORDS = (
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
)
_UNIT_PATTERNS = [re.compile(word + r"(es)?(s)? *(\^[0-9]+)?") for word in _UNIT_WORDS]
_CARET_CIRC = re.compile(r"\^ *\\circ")
_THIN_SPACE_SEPARATOR = re.compile(r",\\! *")
_MINUS_SPACE = re.compile(r"- *")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")
_GROUPED_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")  # \d: any Unicode digit, as upstream
_INTEGER_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")  # `.` is any character, as upstream
_TEXT_SYMBOLS = {"√": "sqrt", "π": "pi", "∞": "inf", "∪": "U", "·": "*", "×": "*"}
_TUPLE_CHARS = "()[]"


@functools.cache
def _latex_to_text():
    from pylatexenc.latex2text import LatexNodes2Text

    # A malformed answer (`\\frac` with one argument) makes pylatexenc log a warning per call;
    # in a training log that is noise about the model's output, not about the run.
    logging.getLogger("pylatexenc").setLevel(logging.ERROR)
    return LatexNodes2Text()


def _latex_as_text(expr: str) -> str:
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = _latex_to_text().latex_to_text(expr)
    for symbol, word in _TEXT_SYMBOLS.items():
        expr = expr.replace(symbol, word)
    return expr.strip()


def _near_integer(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _drop_grouping_commas(expr: str) -> str:
    """`1,000,000` -> `1000000`; a comma not followed by exactly three digits stays (tuples)."""
    while True:
        dropped = _GROUPED_THOUSANDS.sub(r"\1\3\4", expr)
        if dropped == expr:
            return expr
        expr = dropped


def _is_integer_text(text: str) -> bool:
    value = _as_float(_drop_grouping_commas(text))
    return value is not None and _near_integer(value)


def sympy_normalize(expr: str) -> str:
    """The canonical string DeepScaleR's sympy rule compares (see the module docstring)."""
    whole = _WHOLE_TEXT.search(expr)
    if whole is not None:
        expr = whole.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNIT_PATTERNS:
        expr = unit.sub("", expr)
    expr = _CARET_CIRC.sub("", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = _THIN_SPACE_SEPARATOR.sub("", expr)
    value = _as_float(expr)
    if value is not None and _near_integer(value):
        expr = str(int(round(value)))
    if "\\" in expr:
        with contextlib.suppress(Exception):  # what pylatexenc cannot read stays as it is
            expr = _latex_as_text(expr)
    expr = _MINUS_SPACE.sub("-", expr)
    expr = _MIXED_NUMBER.sub(r"\1+\2", expr)
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _is_integer_text(expr):
        expr = str(int(float(expr.replace(",", ""))))  # truncates: 2.99999999 -> 2, as upstream
    return expr


def _elements(expr: str) -> list[str]:
    expr = _drop_grouping_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if (
        len(expr) > 2
        and expr[0] in _TUPLE_CHARS
        and expr[-1] in _TUPLE_CHARS
        and not any(c in inner for c in _TUPLE_CHARS)
    ):
        return [e.strip() for e in inner.split(",")]
    return [expr]


# ---------------------------------------------------------------------------------------
# 2. the sympy rule: evaluation


class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so that sympy's `except Exception` cannot swallow it."""


class _Refused(Exception):
    """The expression is not one this grader hands to sympy (module docstring, Safety)."""


_HARMLESS_NAMES = frozenset({"sqrt", "frac", "pi", "oo", "zoo", "nan", "ln", "li", "re", "im", "csc", "jn", "yn"})
_OPERATORS = frozenset({"+", "-", "*", "/", "**", "(", ")", "[", "]", ","})
_MAX_FACTORIAL = 1000


@functools.cache
def _sympy_namespace() -> dict:
    """The global names `parse_expr` evaluates with when given none (built once, copied per call)."""
    import sympy

    namespace: dict = {}
    exec("from sympy import *", namespace)  # noqa: S102 - sympy's own default namespace
    for name, obj in vars(builtins).items():
        if isinstance(obj, types.BuiltinFunctionType):
            namespace[name] = obj
    namespace["max"], namespace["min"] = sympy.Max, sympy.Min
    return namespace


def _screen(code: str) -> None:
    """Refuse any Python text that is more than arithmetic on numbers and symbols."""
    previous = None
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            kind, text = token.type, token.string
            if kind in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER):
                continue
            if text == "!":
                if previous is None or not (
                    previous.type == tokenize.NAME
                    or (
                        previous.type == tokenize.NUMBER
                        and previous.string.isdigit()
                        and len(previous.string) <= 4
                        and int(previous.string) <= _MAX_FACTORIAL
                    )
                ):
                    raise _Refused("factorial of something other than a small number or a name")
            elif kind == tokenize.NAME:
                if (
                    keyword.iskeyword(text)
                    or text.startswith("_")
                    or (text in _sympy_namespace() and text not in _HARMLESS_NAMES)
                ):
                    raise _Refused(f"name {text!r}")
            elif kind == tokenize.OP:
                if text not in _OPERATORS:
                    raise _Refused(f"operator {text!r}")
            elif kind != tokenize.NUMBER:
                raise _Refused(f"token {text!r}")
            previous = token
    except tokenize.TokenError as exc:
        raise _Refused("does not tokenise") from exc


def _digits(node) -> float:
    """Upper bound on the decimal digits of the numbers an unevaluated sympy tree evaluates to."""
    import sympy

    if isinstance(node, (sympy.Tuple, tuple, list)):
        raise _Refused("a tuple")
    if not isinstance(node, sympy.Basic):
        raise _Refused(f"a {type(node).__name__}")
    if node.is_Integer or node.is_Rational:
        return float(max(len(str(abs(node.p))), len(str(node.q))))
    if node.is_Pow:
        base, exp = node.args
        if exp.free_symbols:
            return _digits(base) + _digits(exp)
        if _digits(exp) > 5:
            return math.inf
        try:
            size = abs(complex(exp.evalf(15)))
        except (TypeError, ValueError):
            return math.inf
        return _digits(base) * max(1.0, size)
    if isinstance(node, (sympy.factorial, sympy.factorial2, sympy.subfactorial)):
        arg = _digits(node.args[0])
        return math.inf if arg > 4 else 10.0**arg * arg
    if not node.args:
        return 1.0
    return sum(_digits(a) for a in node.args)


def _parse(code: str, evaluate: bool):
    from sympy.parsing import sympy_parser as sp

    transformations = sp.standard_transformations + (sp.implicit_multiplication_application,)
    return sp.parse_expr(code, transformations=transformations, global_dict=dict(_sympy_namespace()), evaluate=evaluate)


@contextlib.contextmanager
def time_budget(seconds: float) -> Iterator[None]:
    """Raise `_Timeout` in the block after `seconds` (SIGALRM), where that is possible.

    Only the main thread may install a signal handler, and an itimer already running
    belongs to someone else: in those cases the block runs unguarded (the screening and
    size limits still hold).
    """
    usable = (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    )
    if not usable:
        yield
        return

    def _alarm(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _sympy_may_try(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return (
        len(letters) <= 2
        and "^{" not in expr
        and "^(" not in expr
        and re.search(r"\^[0-9]+\^", expr) is None
        and re.search(r"\^[0-9][0-9]+", expr) is None
    )


def _sympy_equal(truth: str, given: str) -> bool:
    expr = f"({truth})-({given})"
    if not _sympy_may_try(expr):
        return False
    code = expr.replace("^", "**")
    import sympy

    try:
        _screen(code)
        with time_budget(TIME_BUDGET_S), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if _digits(_parse(code, evaluate=False)) > MAX_DIGITS:
                return False
            return bool(sympy.simplify(_parse(code, evaluate=True)) == 0)
    except _Timeout:
        return False
    except Exception:  # noqa: BLE001 - whatever sympy cannot parse or decide is "not equal", as upstream
        return False


def sympy_grade(given: str, truth: str) -> bool:
    """DeepScaleR's sympy rule: is `given` equal to `truth` (both raw answers)?"""
    t, g = sympy_normalize(truth), sympy_normalize(given)
    if t == g:
        return True
    if not g:
        return False
    t_items, g_items = _elements(t), _elements(g)
    if len(t_items) > 1 and (t[0] != g[0] or t[-1] != g[-1]):
        return False
    if len(t_items) != len(g_items):
        return False
    for ti, gi in zip(t_items, g_items, strict=True):
        if _INTEGER_FRACTION.search(ti) and _INTEGER_FRACTION.search(gi):
            if ti != gi:
                return False  # unreduced fractions are wrong: no simplification here
        elif _is_integer_text(ti) != _is_integer_text(gi):
            return False  # an integer must be written as one
        elif not _sympy_equal(ti, gi):
            return False
    return True


@functools.lru_cache(maxsize=16384)  # a GRPO group repeats its answers; so do evaluations at several K
def grade_answer(given: str, truth: str) -> bool:
    """Whether the extracted answer `given` is correct for the ground truth `truth` (DeepScaleR)."""
    return hendrycks_normalize(given) == hendrycks_normalize(truth) or sympy_grade(given, truth)


def math_answer(response: str, label: object) -> float:
    """1.0 iff DeepScaleR's grader calls `response` correct for `label` (see the module docstring)."""
    truths = label_answers(label)
    answer = final_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if any(grade_answer(answer, truth) for truth in truths) else 0.0


def _check_label(label: object) -> None:
    label_answers(label)


math_answer.check_label = _check_label  # type: ignore[attr-defined]

__all__ = [
    "MAX_DIGITS",
    "THINK_END",
    "TIME_BUDGET_S",
    "extract_boxed",
    "final_answer",
    "grade_answer",
    "hendrycks_normalize",
    "label_answers",
    "math_answer",
    "sympy_grade",
    "sympy_normalize",
    "time_budget",
]
