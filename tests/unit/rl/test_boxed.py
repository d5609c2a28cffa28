"""`boxed_answer`: which box is the answer, and the strict integer rule, over a graded table.

Each case is (response, label, expected reward); the table covers nested braces, boxes
inside prose, several boxes, the `</think>` rule, malformed braces, non-integers and
label types. The expected values are written by hand from the rules in `boxed.py`'s
docstring, not computed by the code under test.
"""

from __future__ import annotations

import pytest

from ouro_cli.rl.rewards import boxed_answer
from ouro_cli.rl.rewards.boxed import answer_region, extract_answer, last_boxed

CASES = [
    # plain and in prose
    ("\\boxed{42}", 42, 1.0),
    ("The answer is $\\boxed{42}$.", 42, 1.0),
    ("so we get \\boxed{ 42 } in the end", 42, 1.0),
    ("\\boxed{42}", 41, 0.0),
    ("The answer is 42.", 42, 0.0),  # no box
    ("", 42, 0.0),
    # several boxes: the last wins
    ("first \\boxed{7}, corrected: \\boxed{42}", 42, 1.0),
    ("first \\boxed{42}, corrected: \\boxed{7}", 42, 0.0),
    # nested braces
    ("\\boxed{{42}}", 42, 0.0),  # braces inside are content: `{42}` is not an integer
    ("\\boxed{\\text{x}} then \\boxed{42}", 42, 1.0),
    ("\\boxed{4{2}}", 42, 0.0),
    ("\\boxed{\\frac{84}{2}}", 42, 0.0),  # a fraction is not an integer
    # spelling variants
    ("\\boxed {42}", 42, 1.0),
    ("\\boxed  {42}", 42, 1.0),
    ("\\fbox{42}", 42, 1.0),
    ("\\boxed 42", 42, 0.0),  # no braces: not recognised
    ("\\boxedx{42}", 42, 0.0),  # another command
    # malformed braces
    ("\\boxed{42", 42, 0.0),
    ("\\boxed{7} and then \\boxed{42", 42, 0.0),  # last box malformed: no fallback
    ("\\boxed{7} and then \\boxed{42", 7, 0.0),
    ("\\boxed42}", 42, 0.0),
    # signs and separators
    ("\\boxed{-17}", -17, 1.0),
    ("\\boxed{+17}", 17, 1.0),
    ("\\boxed{\u221217}", -17, 1.0),  # Unicode minus
    ("\\boxed{-17}", 17, 0.0),
    ("\\boxed{1,000}", 1000, 1.0),
    ("\\boxed{1{,}000}", 1000, 1.0),
    ("\\boxed{10,00}", 1000, 0.0),  # not groups of three
    ("\\boxed{1 000}", 1000, 0.0),
    ("\\boxed{007}", 7, 1.0),
    # non-integers
    ("\\boxed{42.0}", 42, 0.0),
    ("\\boxed{42.}", 42, 0.0),
    ("\\boxed{x=42}", 42, 0.0),
    ("\\boxed{42\\%}", 42, 0.0),
    ("\\boxed{forty-two}", 42, 0.0),
    ("\\boxed{}", 42, 0.0),
    ("\\boxed{$42$}", 42, 1.0),
    # the </think> rule
    ("<think>maybe \\boxed{7}</think> The answer is \\boxed{42}.", 42, 1.0),
    ("<think>it is \\boxed{42}</think> I am not sure.", 42, 0.0),  # box only inside thinking
    ("<think>a</think><think>\\boxed{42}</think>\\boxed{7}", 42, 0.0),  # after the LAST </think>
    ("thinking... \\boxed{7}</think>\\boxed{42}", 42, 1.0),  # template opened <think> itself
    ("<think>still thinking \\boxed{42}", 42, 0.0),  # never closed: no answer
    # labels: int, integer string, integral float
    ("\\boxed{42}", "42", 1.0),
    ("\\boxed{42}", " 42 ", 1.0),
    ("\\boxed{42}", 42.0, 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
]


@pytest.mark.parametrize("response,label,expected", CASES)
def test_boxed_answer_table(response, label, expected):
    assert boxed_answer(response, label) == expected


def test_table_is_large_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("label", ["abc", "4.5", 4.5, True, None, [42], "\\frac{1}{2}"])
def test_non_integer_labels_are_refused(label):
    with pytest.raises(ValueError):
        boxed_answer("\\boxed{42}", label)
    with pytest.raises(ValueError):
        boxed_answer.check_label(label)


def test_extraction_helpers():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"  # escaped braces are not delimiters
    assert last_boxed("\\boxed{a\\\\}b}") == "a\\\\"  # `\\` is an escaped backslash, then `}` closes
    assert answer_region("no tags") == "no tags"
    assert answer_region("<think>x</think>y") == "y"
    assert answer_region("<think>x") is None
    assert extract_answer("<think>\\boxed{1}</think>\\boxed{2}") == "2"


def test_returns_float():
    assert type(boxed_answer("\\boxed{1}", 1)) is float
    assert type(boxed_answer("nothing", 1)) is float
