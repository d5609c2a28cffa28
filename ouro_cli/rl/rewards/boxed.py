"""`boxed_answer`: reward 1.0 when the last `\\boxed{...}` of the answer holds the integer label.

This is the strict, cheap reward for integer-answer data (AIME-style, GSM8K-style). Its
rules for *which* text is the answer are ours (`math_verify_answer` shares the answer
region); `math_answer` follows DeepScaleR's instead (`math_grader.py`), which needs
`</think>` and does not honour `\\boxed {}` or `\\fbox`:

- The answer region (`answer_region`): the text after the last `</think>`. A response
  with no think tags at all is searched whole (base and instruct models never write
  them). A response that opens `<think>` and never closes it was cut off while
  thinking: it has no answer region and scores 0, so a box written mid-thought is not
  rewarded.
- The answer (`last_boxed`): the content of the last `\\boxed{...}` (also
  `\\boxed {...}` and `\\fbox{...}`) in the region, found with a brace-matching scan
  that honours nested braces and skips escaped ones (`\\{`, `\\}`). If that last box
  never closes, the answer is malformed and there is none: an earlier box is not used
  instead. `\\boxed 5` (no braces) is not recognised.

Integer rule (`parse_integer`): the box content, after trimming whitespace and `$`,
must be an optional sign (`+`, `-`, or the Unicode minus) followed by digits, or digits
grouped by thousands separators in groups of three (`1,000,000`, LaTeX `1{,}000`).
Anything else -- `12.0`, `12.`, `\\frac{24}{2}`, `x=12`, `12\\%` -- is not an integer and
scores 0; equivalence is the math grader's job, not this reward's.
"""

from __future__ import annotations

import re

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_INT_RE = re.compile(r"[+-]?(?:\d+|\d{1,3}(?:,\d{3})+)")


def answer_region(response: str) -> str | None:
    """The part of `response` that may hold the final answer (None: there is none)."""
    cut = response.rfind(_THINK_CLOSE)
    if cut >= 0:
        return response[cut + len(_THINK_CLOSE) :]
    if _THINK_OPEN in response:
        return None
    return response


def _matching_brace(text: str, open_at: int) -> int | None:
    """Index of the `}` closing the `{` at `open_at`, or None if it never closes."""
    depth = 0
    i = open_at
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # an escaped character (`\{`, `\}`, `\\`) is never a delimiter
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` in `text` (None: no well-formed last box)."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    end = matches[-1].end()
    while end < len(text) and text[end].isspace():
        end += 1
    if end >= len(text) or text[end] != "{":
        return None
    close = _matching_brace(text, end)
    if close is None:
        return None
    return text[end + 1 : close]


def extract_answer(response: str) -> str | None:
    """The last boxed answer in the answer region of `response` (see the module docstring)."""
    region = answer_region(response)
    return None if region is None else last_boxed(region)


def parse_integer(text: str) -> int | None:
    """`text` as an integer under the rule in the module docstring, else None."""
    s = text.replace("{,}", ",").replace("\u2212", "-").strip().strip("$").strip()
    if not _INT_RE.fullmatch(s):
        return None
    return int(s.replace(",", ""))


def integer_label(label: object) -> int:
    """The integer a label stands for: an int, an integral float, or a string `parse_integer` accepts."""
    if isinstance(label, bool):
        raise ValueError(f"label {label!r} is a boolean, not an integer")
    if isinstance(label, int):
        return label
    if isinstance(label, float) and label.is_integer():
        return int(label)
    if isinstance(label, str):
        value = parse_integer(label)
        if value is not None:
            return value
    raise ValueError(f"boxed_answer needs an integer label, got {label!r}")


def boxed_answer(response: str, label: object) -> float:
    """1.0 iff the last boxed answer (after the last `</think>`) is an integer equal to `label`."""
    target = integer_label(label)
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    value = parse_integer(answer)
    return 1.0 if value is not None and value == target else 0.0


def _check_label(label: object) -> None:
    integer_label(label)


# Optional plugin hook: lets `ouro train` reject a bad label before any model loads.
boxed_answer.check_label = _check_label  # type: ignore[attr-defined]

__all__ = ["answer_region", "boxed_answer", "extract_answer", "integer_label", "last_boxed", "parse_integer"]
