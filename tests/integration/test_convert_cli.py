"""`ouro convert` and `ouro export` end to end: the real CLI in a subprocess on a tiny checkpoint.

Checks the artifacts (weights bit for bit, manifest.json, COMPLETE, copied tokenizer and
remote-code files), exit codes, `--json`, `--overwrite`, and that every bad input ends
with exit 2, one line on stderr and no output directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ouro_cli.checkpoint import read_checkpoint, write_hf
from ouro_cli.model import build, tiny_config

REPO = Path(__file__).resolve().parents[2]
ASSETS = {
    "modeling_ouro.py": "# remote code\nclass OuroForCausalLM: ...\n",
    "configuration_ouro.py": "# remote code\nclass OuroConfig: ...\n",
    "tokenizer.json": '{"version": "1.0"}',
    "tokenizer_config.json": '{"chat_template": "{{ messages }}"}',
    "special_tokens_map.json": '{"eos_token": "<|endoftext|>"}',
    "generation_config.json": '{"eos_token_id": [0, 2]}',
}


def ouro(*commands: list[object]) -> list[subprocess.CompletedProcess]:
    """Run `ouro` once per command, all at the same time (each pays ~2-5 s of imports)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ouro_cli.cli.app", *map(str, args)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    results = []
    for proc, args in zip(procs, commands, strict=True):
        stdout, stderr = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    return results


def write_hf_dir(path: Path, config, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    write_hf(path, config, tensors.items())
    for name, text in ASSETS.items():
        (path / name).write_text(text)
    return path


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def assert_artifact(path: Path, command: str) -> dict:
    assert (path / "COMPLETE").is_file()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["command"] == command
    assert manifest["inputs"] and all(len(i["sha256"]) == 64 for i in manifest["inputs"])
    return manifest


@pytest.fixture(scope="module")
def model():
    return build(tiny_config(), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def hf_dir(model, tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("in") / "hf", model.config, model.state_dict())


@pytest.fixture(scope="module")
def mcore_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mcore") / "ckpt"
    (result,) = ouro(["convert", "hf-to-mcore", hf_dir, out, "--json"])
    assert result.returncode == 0, result.stderr
    return out, result


@pytest.fixture(scope="module")
def hf_outputs(mcore_dir, tmp_path_factory):
    """mcore-to-hf of the checkpoint, and export of a run directory holding it into a
    populated directory with --overwrite and small shards."""
    root = tmp_path_factory.mktemp("hf_outputs")
    shutil.copytree(mcore_dir[0], root / "run" / "checkpoint")
    (root / "export").mkdir()
    (root / "export" / "stale.txt").write_text("old")
    converted, exported = ouro(
        ["convert", "mcore-to-hf", mcore_dir[0], root / "hf_back"],
        ["export", root / "run", root / "export", "--overwrite", "--max-shard-size", "40kB", "--json"],
    )
    return {"convert": (converted, root / "hf_back"), "export": (exported, root / "export")}


@pytest.fixture(scope="module")
def bad_runs(model, hf_dir, mcore_dir, tmp_path_factory):
    """Every bad-input case, run concurrently: name -> (result, OUT). (Cases that need no
    subprocess to be believed — a missing path, a bad size string — are unit-tested.)"""
    root = tmp_path_factory.mktemp("bad")
    cases: dict[str, tuple[list[object], Path]] = {}

    tensors = dict(model.state_dict())
    del tensors["model.norm.weight"]
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(4)
    tensors["lm_head.weight"] = torch.zeros(3, 64)
    mismatched = write_hf_dir(root / "mismatched", model.config, tensors)
    cases["mismatched"] = (["convert", "hf-to-mcore", mismatched, root / "out1"], root / "out1")

    llama = shutil.copytree(hf_dir, root / "llama")
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    cases["model_type"] = (["convert", "hf-to-mcore", llama, root / "out2"], root / "out2")

    truncated = shutil.copytree(hf_dir, root / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases["truncated"] = (["convert", "hf-to-mcore", truncated, root / "out3", "--json"], root / "out3")

    incomplete = shutil.copytree(mcore_dir[0], root / "incomplete")
    (incomplete / "release" / "COMPLETE").unlink()
    cases["incomplete"] = (["export", incomplete, root / "out4"], root / "out4")

    populated = root / "populated"
    populated.mkdir()
    (populated / "keep.txt").write_text("mine")
    cases["populated"] = (["convert", "hf-to-mcore", hf_dir, populated], populated)

    results = ouro(*(args for args, _ in cases.values()))
    return {name: (result, out) for (name, (_, out)), result in zip(cases.items(), results, strict=True)}


def test_hf_to_mcore(model, mcore_dir):
    out, result = mcore_dir
    doc = json.loads(result.stdout)  # exactly one JSON document
    assert doc["ok"] is True and doc["output"] == str(out.resolve())
    assert doc["tensors"] == 27 and doc["parameters"] == sum(t.numel() for t in model.state_dict().values())
    assert doc["dtypes"] == ["bfloat16"] and doc["seconds"] > 0
    assert_artifact(out, "convert hf-to-mcore")
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert (out / "release" / "COMPLETE").is_file()
    for name, text in ASSETS.items():
        assert (out / "hf_assets" / name).read_text() == text
    assert_bit_exact(read_checkpoint(out)[1], model.state_dict())


def test_mcore_to_hf(model, hf_dir, hf_outputs):
    result, out = hf_outputs["convert"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # human output goes to stderr
    assert_artifact(out, "convert mcore-to-hf")
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    for name, text in ASSETS.items():
        assert (out / name).read_text() == text
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert_bit_exact(read_checkpoint(out)[1], model.state_dict())


def test_export_of_a_run_dir_with_overwrite_and_shards(model, hf_outputs):
    result, out = hf_outputs["export"]
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and len(doc["files"]) > 2
    assert doc["input"].endswith("run/checkpoint/release")
    assert not (out / "stale.txt").exists()
    assert_artifact(out, "export")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == doc["files"]
    for name, text in ASSETS.items():
        assert (out / name).read_text() == text
    assert_bit_exact(read_checkpoint(out)[1], model.state_dict())


@pytest.mark.parametrize(
    "case, needle",
    [
        ("mismatched", "missing tensors: model.norm.weight"),
        ("model_type", "model_type is 'llama'"),
        ("truncated", "truncated or corrupt"),
        ("incomplete", "incomplete (no COMPLETE marker)"),
    ],
)
def test_bad_input_exits_2_in_one_line_and_leaves_no_output(bad_runs, case, needle):
    result, out = bad_runs[case]
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert needle in lines[0]
    assert "Traceback" not in result.stderr
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*"))  # no staging residue


def test_mismatch_report_lists_every_problem(bad_runs):
    message = bad_runs["mismatched"][0].stderr
    assert "unexpected tensors: model.layers.7.mlp.up_proj.weight" in message
    assert "lm_head.weight [3, 64] (expected [128, 64])" in message


def test_json_error_document(bad_runs):
    doc = json.loads(bad_runs["truncated"][0].stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "model.safetensors" in doc["error"]


def test_populated_output_is_refused_and_left_alone(bad_runs):
    result, out = bad_runs["populated"]
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
