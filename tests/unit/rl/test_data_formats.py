"""Data in the formats people have: Parquet files and `datasets` directories, read through the
column mapping (nested keys, benchmark field names, the gsm8k label parser), with bad rows
named `file:row` as JSONL lines are named `file:line`."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl.data import (
    Columns,
    check_mapping,
    data_sha256,
    gsm8k_label,
    load_dataset,
    scan_dataset,
)

# verl's layout (its DeepScaleR / MATH / GSM8K preprocessing): chat-message prompt, the answer
# under reward_model, the index under extra_info
VERL = [
    {
        "data_source": "deepscaler",
        "prompt": [{"role": "user", "content": f"Problem {i}?"}],
        "ability": "math",
        "reward_model": {"ground_truth": f"\\frac{{{i}}}{{2}}", "style": "rule"},
        "extra_info": {"index": 100 + i, "split": "train"},
    }
    for i in range(4)
]
VERL_COLUMNS = Columns(label="reward_model.ground_truth", id="extra_info.index")
MATH500 = [
    {"problem": f"What is {i}+1?", "answer": str(i + 1), "subject": "Algebra", "unique_id": f"test/{i}.json"}
    for i in range(3)
]
MATH500_COLUMNS = Columns(prompt="problem", label="answer", id="unique_id")


def parquet(tmp_path, records, name="data.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def jsonl(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def fields(rows):
    return [(r.index, r.line, r.prompt, r.label, r.problem_id, r.metadata) for r in rows]


def test_verl_parquet_through_nested_keys(tmp_path):
    rows = load_dataset(parquet(tmp_path, VERL), VERL_COLUMNS)
    assert fields(rows) == [
        (i, i + 1, ({"role": "user", "content": f"Problem {i}?"},), f"\\frac{{{i}}}{{2}}", 100 + i, {})
        for i in range(4)
    ]
    assert all(r.is_chat for r in rows)


def test_parquet_and_jsonl_of_the_same_records_give_the_same_rows(tmp_path):
    for records, columns in ((MATH500, MATH500_COLUMNS), (VERL, VERL_COLUMNS)):
        assert fields(load_dataset(parquet(tmp_path, records), columns)) == fields(
            load_dataset(jsonl(tmp_path, records), columns)
        )


def test_our_schema_reads_from_parquet_with_the_default_mapping(tmp_path):
    records = [
        {"prompt": "What is 2+3?", "label": 5, "metadata": {"problem_id": "p0"}},
        {"prompt": "What is 1+1?", "label": 2, "metadata": {"problem_id": None}},
    ]
    rows = load_dataset(parquet(tmp_path, records))
    assert [(r.prompt, r.label, r.problem_id) for r in rows] == [("What is 2+3?", 5, "p0"), ("What is 1+1?", 2, 1)]
    assert rows[0].metadata == {"problem_id": "p0"}  # the metadata object is the reward's third argument


def test_benchmark_field_names(tmp_path):
    rows = load_dataset(jsonl(tmp_path, MATH500), MATH500_COLUMNS)
    assert [(r.prompt, r.label, r.problem_id) for r in rows] == [
        ("What is 0+1?", "1", "test/0.json"),
        ("What is 1+1?", "2", "test/1.json"),
        ("What is 2+1?", "3", "test/2.json"),
    ]
    aime = [{"id": 60, "problem": "Find x.", "answer": "204", "solution": "..."}]  # AIME 2024's layout
    assert fields(load_dataset(parquet(tmp_path, aime), Columns(prompt="problem", label="answer", id="id"))) == [
        (0, 1, "Find x.", "204", 60, {})
    ]


GSM8K = [
    {
        "question": "Natalia sold clips to 48 friends, then half as many. How many?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72",
    },
    {"question": "A big sale?", "answer": "600 + 600 = <<600+600=1200>>1,200\n#### 1,200"},
    {"question": "Below zero?", "answer": "5 - 8 = -3\n#### -3"},
]


def test_gsm8k_label_parser(tmp_path):
    rows = load_dataset(parquet(tmp_path, GSM8K), Columns(prompt="question", label="answer", label_parser="gsm8k"))
    assert [r.label for r in rows] == ["72", "1200", "-3"]
    assert [r.problem_id for r in rows] == [0, 1, 2]
    # without the parser the label is the whole answer text: the reward would see "... #### 72"
    assert (
        load_dataset(parquet(tmp_path, GSM8K), Columns(prompt="question", label="answer"))[0].label
        == GSM8K[0]["answer"]
    )
    with pytest.raises(ValueError, match="has no '#### <number>'"):
        gsm8k_label("the answer is 72")
    with pytest.raises(ValueError, match="is a number"):
        gsm8k_label(72)


def test_gsm8k_parser_names_the_row_without_an_answer(tmp_path):
    path = parquet(tmp_path, [*GSM8K, {"question": "No answer?", "answer": "it is 4"}])
    with pytest.raises(UserError, match=r"data.parquet:4: \"answer\" has no '#### <number>'"):
        load_dataset(path, Columns(prompt="question", label="answer", label_parser="gsm8k"))


BAD_PARQUET = [
    # (records, columns, the message of the first bad row, which is row 2)
    ([MATH500[0], {**MATH500[1], "answer": None}], MATH500_COLUMNS, '"answer" is null'),
    ([MATH500[0], {**MATH500[1], "problem": "  "}], MATH500_COLUMNS, 'empty "problem"'),
    (
        [VERL[0], {**VERL[1], "reward_model": None}],
        VERL_COLUMNS,
        'missing "reward_model.ground_truth" (the row\'s fields: '
        "data_source, prompt, ability, reward_model, extra_info)",
    ),
    (
        [VERL[0], {**VERL[1], "prompt": [{"role": "user", "content": " "}]}],
        VERL_COLUMNS,
        'empty "prompt" (every message content is blank)',
    ),
    ([MATH500[0], {**MATH500[1], "unique_id": ""}], MATH500_COLUMNS, '"unique_id" is empty'),
    (
        [MATH500[0], {**MATH500[1], "unique_id": MATH500[0]["unique_id"]}],
        MATH500_COLUMNS,
        "problem_id 'test/0.json' repeats row 1",
    ),
]


@pytest.mark.parametrize("records,columns,message", BAD_PARQUET)
def test_bad_parquet_row_names_file_and_row(tmp_path, records, columns, message):
    path = parquet(tmp_path, records)
    with pytest.raises(UserError) as info:
        load_dataset(path, columns)
    assert str(info.value) == f"{path}:2: {message}"


def test_a_missing_column_names_the_columns_there_are(tmp_path):
    path = parquet(tmp_path, GSM8K)
    with pytest.raises(UserError) as info:
        load_dataset(path)  # our schema's "prompt" on GSM8K's columns
    assert str(info.value) == f'{path}:1: missing "prompt" (the row\'s fields: question, answer) (and 2 more bad rows)'


def test_nested_key_through_a_non_object(tmp_path):
    path = jsonl(tmp_path, [{"prompt": "x", "reward_model": "42"}])
    with pytest.raises(
        UserError, match=r'data.jsonl:1: "reward_model" is a string, expected an object holding "ground_truth"'
    ):
        load_dataset(path, Columns(label="reward_model.ground_truth"))


def test_a_column_named_with_dots_is_used_as_it_is(tmp_path):
    # datasets' flatten() writes nested fields as columns named "reward_model.ground_truth"
    records = [{"prompt": "x", "reward_model.ground_truth": "7", "reward_model": {"ground_truth": "other"}}]
    assert load_dataset(parquet(tmp_path, records), Columns(label="reward_model.ground_truth"))[0].label == "7"
    flat = [{"prompt": "x", "reward_model.ground_truth": "7"}]
    assert load_dataset(parquet(tmp_path, flat), Columns(label="reward_model.ground_truth"))[0].label == "7"


def test_an_id_key_no_row_has_is_an_error(tmp_path):
    path = parquet(tmp_path, MATH500)
    with pytest.raises(UserError, match=r'data.parquet: no row has the id key "uniqe_id"'):
        load_dataset(path, Columns(prompt="problem", label="answer", id="uniqe_id"))
    # the default id key may be absent: the rows are numbered
    assert [r.problem_id for r in load_dataset(path, Columns(prompt="problem", label="answer"))] == [0, 1, 2]


def test_a_columnar_source_reads_only_the_mapped_columns(tmp_path):
    source = scan_dataset(parquet(tmp_path, VERL), VERL_COLUMNS).source
    assert source.format == "parquet" and source.unit == "row"
    assert source.columns == ("data_source", "prompt", "ability", "reward_model", "extra_info")
    _, first = next(iter(source.records(VERL_COLUMNS.keys)))
    assert set(first) == {"prompt", "reward_model", "extra_info"}


def test_parquet_is_known_by_its_magic_bytes(tmp_path):
    path = parquet(tmp_path, MATH500, name="math500.data")
    assert scan_dataset(path, MATH500_COLUMNS).source.format == "parquet"
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match="broken.parquet: not a readable Parquet file"):
        load_dataset(broken)


def test_empty_parquet(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "label": pa.array([], pa.int64())}), path)
    with pytest.raises(UserError, match="empty.parquet: no data rows"):
        load_dataset(path)


def test_sha256_of_parquet_and_of_a_directory(tmp_path):
    path = parquet(tmp_path, MATH500)
    assert data_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        (d / "sub").mkdir(parents=True)
        (d / "state.json").write_text("{}")
        (d / "sub" / "data-00000-of-00001.arrow").write_bytes(b"rows")
    assert data_sha256(one) == data_sha256(two)
    (two / "sub" / "data-00000-of-00001.arrow").write_bytes(b"rowz")
    assert data_sha256(one) != data_sha256(two)
    (two / "sub" / "data-00000-of-00001.arrow").rename(two / "data-00000-of-00001.arrow")
    (two / "sub" / "data-00000-of-00001.arrow").write_bytes(b"rows")
    (two / "data-00000-of-00001.arrow").unlink()
    assert data_sha256(one) == data_sha256(two)
    (two / "sub" / "data-00000-of-00001.arrow").rename(two / "sub" / "data-00001.arrow")
    assert data_sha256(one) != data_sha256(two)  # a file's path counts, not only its bytes


def test_a_directory_that_is_not_a_dataset(tmp_path):
    with pytest.raises(UserError, match="is a directory, not a data file"):
        load_dataset(tmp_path)


def test_a_dataset_directory_without_datasets_installed_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(UserError) as info:
        load_dataset(tmp_path)
    assert str(info.value) == (
        f"{tmp_path} is a datasets directory (save_to_disk); reading it needs the datasets "
        "library: pip install 'ouro-cli[hf]' (or pip install datasets)"
    )


def test_datasets_directories(tmp_path):
    datasets = pytest.importorskip("datasets")
    expected = fields(load_dataset(parquet(tmp_path, VERL), VERL_COLUMNS))
    dataset = datasets.Dataset.from_list(VERL)
    dataset.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "dict"))
    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(tmp_path / "splits"))
    for path in (tmp_path / "one", tmp_path / "dict", tmp_path / "splits" / "test"):
        scan = scan_dataset(path, VERL_COLUMNS)
        assert scan.source.format == "datasets" and not scan.errors
        assert fields(scan.rows) == expected, path
    with pytest.raises(
        UserError, match=r"splits holds the splits train, test; pass one of them, e\.g\. .*splits/train"
    ):
        load_dataset(tmp_path / "splits", VERL_COLUMNS)
    datasets.Dataset.from_list(
        [VERL[0], {**VERL[1], "reward_model": {"ground_truth": None, "style": "rule"}}]
    ).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(UserError, match=r'bad:2: "reward_model.ground_truth" is null$'):
        load_dataset(tmp_path / "bad", VERL_COLUMNS)
    with pytest.raises(UserError) as info:  # no column of the mapping: every row is bad, none is lost
        load_dataset(tmp_path / "one", Columns(prompt="problem", label="answer"))
    assert str(info.value).startswith(f'{tmp_path / "one"}:1: missing "problem" (the row\'s fields: data_source, ')
    assert str(info.value).endswith("(and 3 more bad rows)")
    shutil.copytree(tmp_path / "one", tmp_path / "copy")
    assert data_sha256(tmp_path / "one") == data_sha256(tmp_path / "copy")


def test_check_mapping():
    check_mapping(
        {
            "--prompt-key": "problem",
            "--label-key": "reward_model.ground_truth",
            "--id-key": None,
            "--label-parser": "gsm8k",
            "--eval-label-parser": None,
        }
    )
    with pytest.raises(UserError, match="--label-parser must be one of none, gsm8k, got 'math'"):
        check_mapping({"--label-parser": "math"})
    with pytest.raises(UserError, match="--eval-prompt-key must name a field"):
        check_mapping({"--eval-prompt-key": " "})
