"""Data in the formats people have, end to end: a Parquet file with other column names (nested
ones included) trains and evaluates on the bundled tiny model; a Parquet file or datasets
directory evaluates exactly as the same rows in JSONL do; a bad row stops a command before any
model loads, naming `file:row`; `ouro data check` reports and exits 0 or 2."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ouro_cli.bundled import TINY

from .harness import error_line

REPO = Path(__file__).resolve().parents[2]
EVAL_ROWS = 8


def ouro(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.pop("OURO_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "ouro_cli.cli.app", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def bundled(name: str, n: int) -> list[dict]:
    return [json.loads(line) for line in (TINY / name).read_text().splitlines()[:n]]


def own_layout(row: dict) -> dict:
    """A bundled row in a layout of its own: the label nested, other names throughout."""
    return {
        "question": row["prompt"],
        "solution": {"final": str(row["label"]), "steps": "..."},
        "uid": row["metadata"]["problem_id"],
    }


def math500_layout(row: dict) -> dict:
    """A bundled row under MATH-500's field names."""
    return {
        "problem": row["prompt"],
        "answer": str(row["label"]),
        "subject": "Arithmetic",
        "unique_id": row["metadata"]["problem_id"],
    }


TRAIN_MAPPING = ["--prompt-key", "question", "--label-key", "solution.final", "--id-key", "uid"]
MATH500_MAPPING = ["--prompt-key", "problem", "--label-key", "answer", "--id-key", "unique_id"]


def write_parquet(path: Path, records: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_parquet(root / "train.parquet", [own_layout(r) for r in bundled("train.jsonl", 32)])
    eval_rows = bundled("eval.jsonl", EVAL_ROWS)
    write_parquet(root / "eval.parquet", [math500_layout(r) for r in eval_rows])
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
    return root


def test_a_parquet_file_with_other_column_names_trains(files):
    run = files / "run"
    proc = ouro(
        "train",
        "--data",
        files / "train.parquet",
        *TRAIN_MAPPING,
        "--eval-data",
        files / "eval.parquet",
        "--eval-prompt-key",
        "problem",
        "--eval-label-key",
        "answer",
        "--eval-id-key",
        "unique_id",
        "--updates",
        "2",
        "--depths",
        "2",
        "4",
        "--prompts-per-update",
        "2",
        "--group-size",
        "3",
        "--max-response-len",
        "8",
        "--eval-prompts",
        "4",
        "--eval-depths",
        "2",
        "--max-num-seqs",
        "8",
        "--device",
        "cpu",
        "--run-dir",
        run,
        "--json",
        cwd=files,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"]
    assert [json.loads(x)["k"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [2, 4]
    uids = {r["metadata"]["problem_id"] for r in bundled("train.jsonl", 32)}
    for update in range(2):
        records = [json.loads(x) for x in (run / "rollouts" / f"update_{update:06d}.jsonl").read_text().splitlines()]
        assert len(records) == 6 and {r["problem_id"] for r in records} <= uids
    evals = [json.loads(x) for x in (run / "evaluations.jsonl").read_text().splitlines()]
    assert [(e["when"], e["k"], e["prompts"]) for e in evals] == [("start", 2, 4), ("end", 2, 4)]
    plan = json.loads((run / "ouro-plan.json").read_text())
    contract = plan["contract"]
    assert (contract["prompt_key"], contract["label_key"], contract["id_key"], contract["label_parser"]) == (
        "question",
        "solution.final",
        "uid",
        "none",
    )
    assert "eval_prompt_key" not in contract and plan["options"]["eval_prompt_key"] == "problem"
    assert contract["data_sha256"] == hashlib.sha256((files / "train.parquet").read_bytes()).hexdigest()
    manifest = json.loads((run / "manifest.json").read_text())
    assert [Path(i["path"]).name for i in manifest["inputs"]] == ["train.parquet"]


def _evaluations(files: Path, data: Path, mapping: list[str], out: str) -> list[dict]:
    proc = ouro(
        "eval",
        TINY / "model",
        "--data",
        data,
        *mapping,
        "--depths",
        "2",
        "4",
        "--prompts",
        EVAL_ROWS,
        "--max-response-len",
        "12",
        "--device",
        "cpu",
        "--out",
        files / out,
        "--json",
        cwd=files,
    )
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    manifest = json.loads((files / out / "manifest.json").read_text())
    assert manifest["options"]["prompt_key"] == (mapping[1] if mapping else "prompt")
    return document["evaluations"]


@pytest.fixture(scope="module")
def jsonl_evaluations(files) -> list[dict]:
    return _evaluations(files, files / "eval.jsonl", [], "eval-jsonl")


def test_eval_of_parquet_through_the_mapping_equals_eval_of_the_same_rows_in_jsonl(files, jsonl_evaluations):
    assert _evaluations(files, files / "eval.parquet", MATH500_MAPPING, "eval-parquet") == jsonl_evaluations
    assert [e["prompts"] for e in jsonl_evaluations] == [EVAL_ROWS, EVAL_ROWS]


def test_eval_of_a_datasets_directory_equals_eval_of_the_same_rows_in_jsonl(files, jsonl_evaluations):
    datasets = pytest.importorskip("datasets")
    directory = files / "math500"
    datasets.Dataset.from_list([math500_layout(r) for r in bundled("eval.jsonl", EVAL_ROWS)]).save_to_disk(
        str(directory)
    )
    assert _evaluations(files, directory, MATH500_MAPPING, "eval-datasets") == jsonl_evaluations


def test_a_bad_parquet_row_stops_train_and_eval_before_any_model_loads(files, tmp_path):
    rows = [own_layout(r) for r in bundled("train.jsonl", 4)]
    rows[2]["solution"] = None
    bad = write_parquet(tmp_path / "bad.parquet", rows)
    expected = f'{bad}:3: missing "solution.final" (the row\'s fields: question, solution, uid)'
    proc = ouro("train", "--data", bad, *TRAIN_MAPPING, "--run-dir", tmp_path / "run", "--json", cwd=tmp_path)
    assert proc.returncode == 2
    assert error_line(proc) == f"error: {expected}"
    assert json.loads(proc.stdout) == {"ok": False, "error": expected, "exit_code": 2}
    assert not (tmp_path / "run").exists()
    proc = ouro("eval", TINY / "model", "--data", bad, *TRAIN_MAPPING, "--out", tmp_path / "ev", cwd=tmp_path)
    assert proc.returncode == 2 and error_line(proc) == f"error: {expected}"
    assert not (tmp_path / "ev").exists()


def test_data_check_reports_a_good_file(files):
    proc = ouro(
        *("data", "check", files / "train.parquet", *TRAIN_MAPPING, "--model", TINY / "model"),
        *("--reward-function", "auto", "--json"),
        cwd=files,
    )
    assert proc.returncode == 0, proc.stderr
    (report,) = json.loads(proc.stdout)["files"]
    assert (report["format"], report["rows"], report["valid_rows"], report["bad_rows"]) == ("parquet", 32, 32, 0)
    first = bundled("train.jsonl", 1)[0]
    assert report["reward_function"] == "ouro_cli.rl.rewards.math_answer"  # what train's auto picks off the bundle
    assert report["example"] == {
        "row": 1,
        "id": first["metadata"]["problem_id"],
        "template": "chatml",
        "prompt": f"<|im_start|>user\n{first['prompt']}<|im_end|>\n<|im_start|>assistant\n",
        "label": str(first["label"]),  # solution.final, as the reward gets it
    }
    assert report["unlabeled"] == {"key": "solution.final", "rows": 0, "first": []}
    assert report["ids"] == {"key": "uid", "own": 32, "row_index": 0}
    assert report["duplicate_ids"] == [] and report["ok"] and report["first_error"] is None
    lengths = report["prompt_length"]
    assert lengths["unit"] == "tokens" and lengths["model_limit"] == 512
    assert lengths["min"] <= lengths["p50"] <= lengths["p90"] <= lengths["p99"] <= lengths["max"]
    # the tokens of the prompt as training renders it (ChatML), counted independently here
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TINY / "model" / "tokenizer.json"))
    counts = sorted(
        len(
            tokenizer.encode(
                f"<|im_start|>user\n{r['prompt']}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
            ).ids
        )
        for r in bundled("train.jsonl", 32)
    )
    assert (lengths["min"], lengths["p50"], lengths["max"]) == (counts[0], counts[15], counts[-1])
    human = ouro("data", "check", files / "train.parquet", *TRAIN_MAPPING, cwd=files)
    assert human.returncode == 0 and human.stderr == ""  # the report is the command's product: stdout
    assert "train.parquet: parquet, 32 rows (32 valid)" in human.stdout
    assert "prompt length in characters" in human.stdout and "ids: 32 from uid, all distinct" in human.stdout
    shown = f"first valid row (row 1, id {first['metadata']['problem_id']!r}) as the model gets it, chatml template:"
    assert shown in human.stdout
    assert f"    {first['prompt']}<|im_end|>\n" in human.stdout
    assert f'its label, as the reward gets it: "{first["label"]}"' in human.stdout


def test_data_check_finds_bad_rows_and_duplicate_ids(files, tmp_path):
    rows = [math500_layout(r) for r in bundled("eval.jsonl", 6)]
    rows[1]["answer"] = None
    rows[4]["unique_id"] = rows[0]["unique_id"]
    bad = write_parquet(tmp_path / "bad.parquet", rows)
    proc = ouro("data", "check", files / "eval.parquet", bad, *MATH500_MAPPING, "--json", cwd=tmp_path)
    assert proc.returncode == 2
    first = f'{bad}:2: "answer" is null'
    document = json.loads(proc.stdout)
    assert document["ok"] is False and document["exit_code"] == 2
    assert document["error"] == f"{first} (and 1 more bad row)"
    good, report = document["files"]
    assert good["ok"] and good["rows"] == EVAL_ROWS
    assert (report["rows"], report["valid_rows"], report["bad_rows"], report["first_bad_row"]) == (6, 5, 1, first)
    assert report["duplicate_ids"] == [{"id": rows[0]["unique_id"], "rows": [1, 5]}]
    assert error_line(proc) == f"error: {first} (and 1 more bad row)"
    assert f"1 duplicated: '{rows[0]['unique_id']}' (rows 1, 5)" in proc.stderr
    unlabeled = {"key": "answer", "rows": 1, "first": [{"row": 2, "id": rows[1]["unique_id"]}]}
    assert report["unlabeled"] == unlabeled and good["unlabeled"]["rows"] == 0
    assert f'rows without a label "answer": 1; the first: row 2 (id {rows[1]["unique_id"]!r})' in proc.stderr


def test_data_check_of_gsm8k_answers_with_and_without_the_label_parser(tmp_path):
    rows = [
        {
            "question": "Natalia sold 48 clips and half as many more. How many?",
            "answer": "48/2 = <<48/2=24>>24\n48+24 = <<48+24=72>>72\n#### 72",
        },
        {"question": "A sale of 1,200 twice?", "answer": "600 + 600 = 1,200\n#### 1,200"},
    ]
    path = write_parquet(tmp_path / "gsm8k.parquet", rows)
    common = [
        "data",
        "check",
        path,
        "--prompt-key",
        "question",
        "--label-key",
        "answer",
        "--reward-function",
        "ouro_cli.rl.rewards.boxed_answer",
    ]
    proc = ouro(*common, "--label-parser", "gsm8k", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["files"][0]["ids"] == {"key": "metadata.problem_id", "own": 0, "row_index": 2}
    proc = ouro(*common, cwd=tmp_path)  # the whole answer text is no integer label
    assert proc.returncode == 2
    assert error_line(proc).startswith(f"error: {path}:1: label '48/2 = ")
    assert "cannot be graded by ouro_cli.rl.rewards.boxed_answer" in error_line(proc)


def test_data_check_of_a_missing_file_and_an_unknown_parser(tmp_path):
    proc = ouro("data", "check", tmp_path / "nope.parquet", "--json", cwd=tmp_path)
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"] == f"data file {tmp_path / 'nope.parquet'} does not exist"
    proc = ouro("data", "check", TINY / "eval.jsonl", "--label-parser", "gsm", cwd=tmp_path)
    assert proc.returncode == 2
    assert error_line(proc) == "error: --label-parser must be one of none, gsm8k, got 'gsm'"
