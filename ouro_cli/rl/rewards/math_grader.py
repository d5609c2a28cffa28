"""`math_answer`: a DeepScaleR-style math grader, the default reward of `ouro train`.

Score 1.0 when the response's final answer is mathematically the label, else 0.0. Three
steps, each a known recipe (Hendrycks' MATH `is_equiv`, DeepScaleR's `grade_answer`):

1. **Which text is the answer** -- shared with `boxed_answer` (see `boxed.py`): the last
   `\\boxed{...}` after the last `</think>`. A response without think tags is searched
   whole; one that opens `<think>` and never closes it has no answer (0). Unlike
   DeepScaleR, which scores every response without `</think>` as 0, a plain response
   is graded, because base and instruct Ouro models do not think in tags.
2. **MATH-style normalisation** of both answer and label (`normalize`): drop `$`,
   `\\!`, thin spaces, `\\left`/`\\right`, degree marks, `\\%`, trailing periods, trailing
   units (`\\text{ cm}`, `\\mbox{ inches}`, `5 cm^2`), `\\text{...}` wrappers; `dfrac`/
   `tfrac` -> `frac`; `\\frac12` -> `\\frac{1}{2}`, `\\sqrt3` -> `\\sqrt{3}`; a short left side
   `x = ...` is dropped; thousands separators (`1,000`, `1{,}000`) removed from a lone
   number; `.5` -> `0.5`; a mixed number `2\\frac{1}{2}` means 2 + 1/2. Equal strings
   are equal answers; word answers (`\\text{Yes}`, `C`) compare case-insensitively. A
   percentage is its number: `10\\%` equals `10`, not `0.1` (as in MATH, whose labels
   drop the sign).
3. **Symbolic equivalence** with sympy: both sides are turned into sympy expressions by
   a small LaTeX converter (`\\frac`, `\\sqrt`, `\\sqrt[n]`, `^`, `\\pi`, `\\infty`, `\\cdot`,
   `\\times`, `\\div`, `\\sin`-family, `\\ln`, `\\log`, `\\exp`, implicit multiplication,
   decimals as exact rationals) and compared: constants numerically to 30 significant
   digits, expressions with variables by `simplify(a - b) == 0`. So `0.5`, `1/2` and
   `\\frac{1}{2}` agree, `2\\sqrt{2}` equals `\\sqrt{8}`, `x+1` equals `1+x`, and an
   unreduced `\\frac{2}{4}` equals `\\frac{1}{2}` (DeepScaleR rejects unreduced
   fractions; we grade the value). Tuples, intervals and lists (`(1, 2]`, `1, 2`) are
   compared element-wise with the same brackets; sets `\\{...\\}` in any order.

Safety: the converter emits only numbers, single-letter symbols, whitelisted function
names and `+-*/()`, and sympy evaluates it with no builtins, so a response cannot
run code. Hangs are prevented by a size limit (answers over 400 characters are compared
as strings only), a magnitude bound (no power towers, no number beyond ~20,000
digits; with variables, ~150 digits, since simplify crawls on big coefficients), and
a wall-clock budget (`TIME_BUDGET_S`) for the symbolic step, enforced
with SIGALRM where it can be (the main thread, no timer already running). A timeout
counts as "not equivalent", the only case where a grade could depend on machine speed.
"""

from __future__ import annotations

import contextlib
import decimal
import functools
import math
import re
import signal
import string
import threading
from collections.abc import Iterator

from .boxed import extract_answer, last_boxed

TIME_BUDGET_S = 2.0
MAX_ANSWER_CHARS = 400
_MAX_DIGITS = 20_000
_MAX_SYMBOLIC_DIGITS = 150

# ---------------------------------------------------------------------------------------
# 2. normalisation


_UNIT_WORDS = (
    "units?", "square units?", "sq units?", "cubic units?", "degrees?", "cm", "mm", "km", "m",
    "centimeters?", "millimeters?", "kilometers?", "meters?", "inch(?:es)?", "in", "feet",
    "foot", "ft", "yards?", "miles?", "seconds?", "minutes?", "hours?", "days?", "weeks?",
    "months?", "years?", "dollars?", "cents?", "pounds?", "ounces?", "grams?", "kg", "g",
    "liters?", "mph", "people", "students", "ways", "times", "points?",
)
_UNIT = "(?:" + "|".join(_UNIT_WORDS) + ")"
_POWER = r"(?:\s*\^\s*\{?\s*[23]\s*\}?)?"
# A unit is only ever trailing: `5\text{ cm}^2`, `5\mbox{cm}`, `5 cm`. A plain word needs a
# space before it, so that a variable (`2m`) is never taken for a unit.
_UNITS_RE = re.compile(r"(?<=\S)(?:\s*\\(?:text|mbox|mathrm)\s*\{\s*" + _UNIT + r"\s*\}|\s+" + _UNIT + r")" + _POWER + r"\s*$")
# Hendrycks' rule: `\text{ ...}` whose text starts with a space is a unit (here: when trailing).
_TRAILING_TEXT_RE = re.compile(r"(?<=\S)\s*\\(?:text|mbox)\s*\{\s+[A-Za-z][A-Za-z .]*\}" + _POWER + r"\s*$")
_WRAPPERS_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{")
_LONE_NUMBER_WITH_COMMAS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_MIXED_NUMBER = re.compile(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}")


def _unwrap_commands(s: str) -> str:
    """`\\text{abc}` -> `abc` for every text-like wrapper (brace matched)."""
    while (m := _WRAPPERS_RE.search(s)) is not None:
        depth, j = 1, m.end()
        while j < len(s) and depth:
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            j += 1
        if depth:
            return s  # unbalanced: leave it, the strings will simply not match
        s = s[:m.start()] + s[m.end():j - 1] + s[j:]
    return s


def _strip_outer_braces(s: str) -> str:
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _closing(s, 0) == len(s) - 1:
        s = s[1:-1]
    return s


def _drop_short_lhs(s: str) -> str:
    parts = s.split("=")
    if len(parts) == 2 and 0 < len(parts[0].strip()) <= 2:
        return parts[1]
    return s


def normalize(answer: str) -> str:
    """MATH-style canonical string of an answer (see the module docstring, step 2)."""
    s = answer.replace("\n", " ").replace("\u2212", "-").strip()
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\!", "")
    s = re.sub(r"\\[,;: >]", " ", s).replace("~", " ").replace("\\\\", " ")
    s = s.replace("\\displaystyle", "")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("cfrac", "frac")
    s = re.sub(r"\\(?:left|right|[Bb]igg?[lr]?)(?![A-Za-z])", "", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("\u00b0", "").replace("\\circ", "")
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\\text\s*\{\s*(or|and)\s*\}", ",", s)
    s = _TRAILING_TEXT_RE.sub("", s)
    s = _UNITS_RE.sub("", s)
    s = _unwrap_commands(s)
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"\\sqrt\s*([0-9A-Za-z])", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac\s*([0-9A-Za-z])\s*([0-9A-Za-z])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*([0-9A-Za-z])\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*\{([^{}]*)\}\s*([0-9A-Za-z])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\s+", "", s)
    s = s.replace("{,}", ",")
    s = _drop_short_lhs(s)
    if _LONE_NUMBER_WITH_COMMAS.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    return _strip_outer_braces(s)


# ---------------------------------------------------------------------------------------
# tuples, intervals, sets

_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = {")": "(", "]": "[", "}": "{"}


def _scan(s: str, start: int = 0):
    """(index, char, bracket depth after it) from `start` on; `\\{` / `\\}` count as one
    bracket, reported at the brace."""
    depth, j = 0, start
    while j < len(s):
        c = s[j]
        if c == "\\" and j + 1 < len(s) and s[j + 1] in "{}":
            j += 1
            c = s[j]
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        yield j, c, depth
        j += 1


def _closing(s: str, i: int) -> int | None:
    """Index where the bracket group opened at `s[i]` closes (any bracket kind), or None."""
    for j, c, depth in _scan(s, i):
        if c in _CLOSE and depth <= 0:
            return j if depth == 0 else None
    return None


def _split_top_level(s: str) -> list[str]:
    items, start = [], 0
    for j, c, depth in _scan(s):
        if c == "," and depth == 0:
            items.append(s[start:j])
            start = j + 1
    items.append(s[start:])
    return items


def split_answer(s: str) -> tuple[str, list[str]]:
    """(brackets, elements): `(1,2]` -> ("(]", ["1", "2"]); `\\{1,2\\}` -> ("{}", ...); `3` -> ("", ["3"])."""
    brackets, inner = "", s
    if s[:2] == "\\{" and s[-2:] == "\\}" and _closing(s, 0) == len(s) - 1:
        brackets, inner = "{}", s[2:-2]
    elif s[:1] in "([" and s[-1:] in ")]" and len(s) >= 2 and _closing(s, 0) == len(s) - 1:
        brackets, inner = s[0] + s[-1], s[1:-1]
    items = _split_top_level(inner)
    if len(items) == 1 and brackets != "{}":
        return "", [s]  # one element in parentheses is grouping, not a tuple
    return brackets, items


# ---------------------------------------------------------------------------------------
# 3. LaTeX -> sympy


class _Unsupported(Exception):
    """The converter does not know this LaTeX; the answer is compared as a string only."""


class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so that sympy's `except Exception` cannot swallow it."""


_FUNCTIONS = {
    "sin": "sin", "cos": "cos", "tan": "tan", "cot": "cot", "sec": "sec", "csc": "csc",
    "arcsin": "asin", "arccos": "acos", "arctan": "atan", "ln": "log", "log": "log", "exp": "exp",
}
_SYMBOLS = {"pi": " pi ", "infty": " oo ", "cdot": "*", "times": "*", "ast": "*", "div": "/"}
_COMMANDS = {"frac", "sqrt", *_FUNCTIONS, *_SYMBOLS}
_COMMANDS_LONGEST_FIRST = sorted(_COMMANDS, key=len, reverse=True)
_SAFE_EXPR = re.compile(r"[0-9A-Za-z+\-*/(). ]*")
_SAFE_NAMES = {"sqrt", "pi", "oo", *_FUNCTIONS.values()}


def _group(s: str, i: int) -> tuple[str, int]:
    """The brace group (or single character) starting at `s[i]`, and the index after it."""
    if i >= len(s):
        raise _Unsupported("missing argument")
    if s[i] == "{":
        close = _closing(s, i)
        if close is None:
            raise _Unsupported("unbalanced braces")
        return s[i + 1:close], close + 1
    if s[i] == "\\":
        m = re.match(r"\\[A-Za-z]+", s[i:])
        if m:
            return m.group(0), i + len(m.group(0))
    return s[i], i + 1


def latex_to_expr(s: str) -> str:
    """A normalised LaTeX answer as a Python expression string that sympy can parse."""
    out: list[str] = []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            m = re.match(r"\\([A-Za-z]+|.)", s[i:])
            name = m.group(1)
            if name not in _COMMANDS:
                # Spaces were removed by `normalize`: `\sin x` arrives as `\sinx`.
                name = next((c for c in _COMMANDS_LONGEST_FIRST if name.startswith(c)), name)
            i += 1 + len(name)
            if name == "frac":
                num, i = _group(s, i)
                den, i = _group(s, i)
                out.append(f"(({latex_to_expr(num)})/({latex_to_expr(den)}))")
            elif name == "sqrt":
                if i < len(s) and s[i] == "[":
                    close = s.find("]", i)
                    if close < 0:
                        raise _Unsupported("unclosed root index")
                    index, i = s[i + 1:close], close + 1
                    body, i = _group(s, i)
                    out.append(f"(({latex_to_expr(body)})**(1/({latex_to_expr(index)})))")
                else:
                    body, i = _group(s, i)
                    out.append(f" sqrt({latex_to_expr(body)})")
            elif name in _SYMBOLS:
                out.append(_SYMBOLS[name])
            elif name in _FUNCTIONS:
                if i < len(s) and s[i] == "(":
                    out.append(f" {_FUNCTIONS[name]}")
                else:
                    arg, i = _group(s, i)
                    out.append(f" {_FUNCTIONS[name]}({latex_to_expr(arg)})")
            else:
                raise _Unsupported(f"\\{name}")
        elif c == "{":
            body, i = _group(s, i)
            out.append(f"({latex_to_expr(body)})")
        elif c == "^":
            arg, i = _group(s, i + 1)
            out.append(f"**({latex_to_expr(arg)})")
        elif c.isdigit() or c == ".":
            m = re.match(r"\d*\.?\d+|\d+\.?", s[i:])
            out.append(f" {m.group(0)} ")
            i += len(m.group(0))
        elif c.isascii() and c.isalpha():
            out.append(f" {c} ")  # one letter, one symbol: `xy` is x*y
            i += 1
        elif c in "+-*/()":
            out.append(c)
            i += 1
        elif c in "[]":
            out.append("(" if c == "[" else ")")
            i += 1
        else:
            raise _Unsupported(c)
    return "".join(out)


@functools.cache
def _sympy_env() -> tuple[dict, dict, tuple]:
    import sympy
    from sympy.parsing import sympy_parser as sp

    names = ("Integer", "Float", "Rational", "Symbol", "Function", "Add", "Mul", "Pow",
             "sqrt", "pi", "oo", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan",
             "log", "exp")
    global_dict = {name: getattr(sympy, name) for name in names}
    global_dict["__builtins__"] = {}
    local_dict = {ch: sympy.Symbol(ch) for ch in string.ascii_letters}
    transformations = sp.standard_transformations + (sp.implicit_multiplication, sp.rationalize)
    return global_dict, local_dict, transformations


def _parse(expr: str, evaluate: bool):
    from sympy.parsing.sympy_parser import parse_expr

    compact = expr.replace(" ", "")
    if not _SAFE_EXPR.fullmatch(expr) or "()" in compact or "//" in compact:
        # `//` would be Python floor division, which sympy evaluates even with evaluate=False
        raise _Unsupported("unsafe characters, empty parentheses or //")
    if any(len(name) > 1 and name not in _SAFE_NAMES for name in re.findall(r"[A-Za-z]+", expr)):
        raise _Unsupported("unknown name")  # only single-letter symbols and whitelisted functions
    global_dict, local_dict, transformations = _sympy_env()
    return parse_expr(expr, local_dict=dict(local_dict), global_dict=dict(global_dict),
                      transformations=transformations, evaluate=evaluate)


def _digits(node) -> float:
    """Upper bound on the decimal digits of the value of a sympy tree (see module docstring)."""
    if node.is_Integer or node.is_Rational:
        return float(max(len(str(abs(node.p))), len(str(node.q))))
    if node.is_Float:
        return float(len(str(node)))
    if node.is_Pow:
        base, exp = node.args
        if exp.free_symbols:
            return _digits(base) + _digits(exp)
        if _digits(exp) > 4:
            return math.inf  # exponent beyond 10^4: a tower or a giant power
        return _digits(base) * max(1.0, abs(float(exp.evalf(15))))
    if not node.args:
        return 1.0
    return sum(_digits(a) for a in node.args)


@functools.lru_cache(maxsize=4096)
def to_sympy(answer: str):
    """A normalised answer element as a sympy expression, or None when it is not one we can read safely."""
    if len(answer) > MAX_ANSWER_CHARS:
        return None
    try:
        expr = latex_to_expr(answer)
        unevaluated = _parse(expr, evaluate=False)
        if _digits(unevaluated) > _MAX_DIGITS:
            return None
        return _parse(expr, evaluate=True)
    except _Timeout:
        raise
    except Exception:  # noqa: BLE001 - anything sympy cannot read is "not an expression"
        return None


def _symbolically_equal(a, b) -> bool:
    import sympy

    if a == b:
        return True
    diff = a - b
    if not diff.free_symbols:
        value = sympy.N(diff, 30)
        scale = max(1.0, abs(complex(sympy.N(b, 30))))
        return value.is_number and value.is_finite is not False and abs(complex(value)) <= 1e-25 * scale
    if _digits(diff) > _MAX_SYMBOLIC_DIGITS:
        return False  # simplify is slow on big coefficients (10^200 x took seconds): not shown equal
    if sympy.expand(diff) == 0:
        return True
    return sympy.simplify(diff) == 0


@contextlib.contextmanager
def time_budget(seconds: float) -> Iterator[None]:
    """Raise `_Timeout` in the block after `seconds` (SIGALRM), where that is possible.

    Only the main thread may install a signal handler, and an itimer already running
    belongs to someone else: in those cases the block runs unguarded (the size and
    magnitude limits still hold).
    """
    usable = (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
              and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))
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


def _elements_equal(given: str, target: str) -> bool:
    given, target = _drop_short_lhs(given), _drop_short_lhs(target)
    if given == target:
        return True
    if re.fullmatch(r"[A-Za-z]+", given) and re.fullmatch(r"[A-Za-z]+", target):
        return given.lower() == target.lower()
    mixed = [_MIXED_NUMBER.fullmatch(x) for x in (given, target)]
    given, target = (f"{m[1]}({m[2]}+\\frac{{{m[3]}}}{{{m[4]}}})" if m else x for m, x in zip(mixed, (given, target), strict=True))
    a, b = to_sympy(given), to_sympy(target)
    if a is None or b is None:
        return False
    try:
        return bool(_symbolically_equal(a, b))
    except _Timeout:
        raise
    except Exception:  # noqa: BLE001 - sympy failing to decide means "not shown equal"
        return False


@functools.lru_cache(maxsize=8192)
def answers_equivalent(given: str, target: str) -> bool:
    """Whether answer `given` is the label `target` (both raw LaTeX, un-normalised)."""
    if len(given) > 4 * MAX_ANSWER_CHARS or len(target) > 4 * MAX_ANSWER_CHARS:
        return given.strip() == target.strip()  # too long to normalise cheaply; never an answer we grade
    g, t = normalize(given), normalize(target)
    if not g or not t:
        return False
    if g == t:
        return True
    if len(g) > MAX_ANSWER_CHARS or len(t) > MAX_ANSWER_CHARS:
        return False
    g_brackets, g_items = split_answer(g)
    t_brackets, t_items = split_answer(t)
    if g_brackets != t_brackets or len(g_items) != len(t_items):
        return False
    try:
        with time_budget(TIME_BUDGET_S):
            if t_brackets == "{}":
                remaining = list(t_items)
                for item in g_items:
                    match = next((r for r in remaining if _elements_equal(item, r)), None)
                    if match is None:
                        return False
                    remaining.remove(match)
                return True
            return all(_elements_equal(x, y) for x, y in zip(g_items, t_items, strict=True))
    except _Timeout:
        return False


def label_text(label: object) -> str:
    """A label as the LaTeX string the grader compares with: numbers printed, `\\boxed{}` unwrapped."""
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise ValueError(f"math_answer needs a string or number label, got {label!r}")
    if isinstance(label, float):
        if not math.isfinite(label):
            raise ValueError(f"math_answer needs a finite label, got {label!r}")
        return format(decimal.Decimal(repr(label)), "f")  # 1e-05 -> 0.00001
    if isinstance(label, int):
        return str(label)
    text = label
    if "\\boxed" in text or "\\fbox" in text:
        text = last_boxed(text) or text
    if not text.strip():
        raise ValueError("math_answer got an empty label")
    return text


def math_answer(response: str, label: object) -> float:
    """1.0 iff the last boxed answer (after the last `</think>`) equals `label` mathematically."""
    target = label_text(label)
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_equivalent(answer, target) else 0.0


def _check_label(label: object) -> None:
    label_text(label)


math_answer.check_label = _check_label  # type: ignore[attr-defined]

__all__ = ["answers_equivalent", "label_text", "latex_to_expr", "math_answer", "normalize", "split_answer",
           "time_budget", "to_sympy"]
