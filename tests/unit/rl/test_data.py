"""Data loading: every malformed row fails before anything runs, naming file and line."""

from __future__ import annotations

import hashlib
import json

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl.data import data_sha256, load_dataset


def write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


GOOD = {"prompt": "What is 2+3?", "label": 5, "metadata": {"problem_id": "p0"}}


def test_good_rows(tmp_path):
    chat = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
        "label": "2",
        "extra": "ignored",
    }
    path = write(tmp_path, [GOOD, "", chat, {"prompt": "x", "label": [1, 2], "metadata": {"problem_id": 7}}])
    rows = load_dataset(path)
    assert [r.index for r in rows] == [0, 1, 2]
    assert [r.line for r in rows] == [1, 3, 4]  # the blank line is skipped, not counted as a row
    assert rows[0].prompt == "What is 2+3?" and rows[0].label == 5 and rows[0].problem_id == "p0"
    assert rows[1].is_chat and rows[1].prompt[1] == {"role": "user", "content": "1+1?"}
    assert rows[1].problem_id == 1  # no metadata: the row's index
    assert rows[2].problem_id == 7 and rows[2].label == [1, 2]


def test_sha256_is_of_the_bytes(tmp_path):
    path = write(tmp_path, [GOOD])
    assert data_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


BAD = [
    ('{"prompt": "x", "label": 1', "bad JSON"),
    ("[1, 2]", "expected a JSON object, got a array"),
    ({"label": 1}, 'missing "prompt"'),
    ({"prompt": "x"}, 'missing "label"'),
    ({"prompt": "x", "label": None}, '"label" is null'),
    ({"prompt": "", "label": 1}, 'empty "prompt"'),
    ({"prompt": "   \n", "label": 1}, 'empty "prompt"'),
    ({"prompt": [], "label": 1}, 'empty "prompt" (no messages)'),
    ({"prompt": [{"content": "hi"}], "label": 1}, 'message 0 has no "role"'),
    ({"prompt": [{"role": "user"}], "label": 1}, 'message 0 has no "content"'),
    ({"prompt": [{"role": "", "content": "hi"}], "label": 1}, 'empty "role"'),
    ({"prompt": [{"role": "user", "content": 3}], "label": 1}, '"content" is a number'),
    ({"prompt": ["hi"], "label": 1}, "message 0 is a string"),
    ({"prompt": [{"role": "user", "content": " "}], "label": 1}, "every message content is blank"),
    ({"prompt": 5, "label": 1}, '"prompt" is a number'),
    ({"prompt": "x", "label": 1, "metadata": []}, '"metadata" is a array'),
    ({"prompt": "x", "label": 1, "metadata": {"problem_id": 1.5}}, 'problem_id" is a number'),
    ({"prompt": "x", "label": 1, "metadata": {"problem_id": True}}, 'problem_id" is a boolean'),
]


@pytest.mark.parametrize("line,message", BAD)
def test_bad_row_names_file_and_line(tmp_path, line, message):
    path = write(tmp_path, [GOOD, {"prompt": "ok", "label": 2}, line])
    with pytest.raises(UserError) as info:
        load_dataset(path)
    text = str(info.value)
    assert text.startswith(f"{path}:3: "), text
    assert message in text
    assert "\n" not in text


def test_first_error_and_count_of_others(tmp_path):
    path = write(tmp_path, [GOOD, {"prompt": "x"}, "{", {"prompt": ""}])
    with pytest.raises(UserError, match=r':2: missing "label" \(the row\'s fields: prompt\) \(and 2 more bad lines\)$'):
        load_dataset(path)


def test_duplicate_problem_ids(tmp_path):
    path = write(tmp_path, [GOOD, {"prompt": "y", "label": 1, "metadata": {"problem_id": "p0"}}])
    with pytest.raises(UserError, match=r":2: problem_id 'p0' repeats line 1"):
        load_dataset(path)
    # a default id (the row index) collides with an explicit one as a string
    path = write(tmp_path, [{"prompt": "a", "label": 1, "metadata": {"problem_id": "1"}}, {"prompt": "b", "label": 1}])
    with pytest.raises(UserError, match="repeats line 1"):
        load_dataset(path)


def test_missing_empty_and_not_utf8(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_dataset(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="is a directory, not a data file"):
        load_dataset(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="no data rows"):
        load_dataset(empty)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(UserError, match=r"bin.jsonl:2: not UTF-8"):
        load_dataset(binary)


def test_bom_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "win.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + json.dumps(GOOD).encode()
        + b"\r\n"
        + json.dumps({"prompt": "b", "label": 1}).encode()
        + b"\r\n"
    )
    assert [r.problem_id for r in load_dataset(path)] == ["p0", 1]


def test_a_scan_lists_the_rows_without_a_label_with_their_ids(tmp_path):
    from ouro_cli.rl.data import Columns, scan_dataset

    lines = [
        GOOD,
        {"prompt": "x", "metadata": {"problem_id": "p1"}},  # no label
        {"prompt": "x", "label": None},  # null label, no id
        {"prompt": "", "label": 3},  # bad for another reason: labelled
        {"question": "x", "metadata": {"problem_id": 9}},  # no prompt and no label
    ]
    scan = scan_dataset(write(tmp_path, lines))
    assert len(scan.bad_rows) == 4 and scan.unlabeled == [(2, "p1"), (3, None), (5, 9)]
    nested = write(tmp_path, [{"prompt": "x", "reward_model": "flat"}], name="nested.jsonl")
    assert scan_dataset(nested, Columns(label="reward_model.ground_truth")).unlabeled == [(1, None)]
