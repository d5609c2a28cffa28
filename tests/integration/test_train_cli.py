"""`ouro train`, `ouro resume`, `ouro export` and `ouro eval` run end to end as real subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .tiny_checkpoint import REWARD, make_checkpoint

REPO = Path(__file__).resolve().parents[2]

T = 4


def ouro(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "ouro_cli.cli.app", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def small(root: Path) -> list[str]:
    return [
        "--model",
        str(root / "hf"),
        "--data",
        str(root / "train.jsonl"),
        "--eval-data",
        str(root / "eval.jsonl"),
        "--prompts-per-update",
        "2",
        "--group-size",
        "3",
        "--max-response-len",
        "6",
        "--eval-prompts",
        "3",
        "--max-num-seqs",
        "4",
        "--reward-function",
        REWARD,
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A three-update run (checkpoints at 2 and 3) that the tests below go on with; a copy of it
    as it finished is under root/finished."""
    root = tmp_path_factory.mktemp("train")
    make_checkpoint(root)
    run = root / "run"
    proc = ouro(
        "train",
        "--depths",
        "2",
        "3",
        "4",
        "--updates",
        "3",
        "--save-interval",
        "2",
        "--run-dir",
        str(run),
        *small(root),
        "--plot",
        "--json",
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    shutil.copytree(run, root / "finished")
    return root, run, json.loads(proc.stdout)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_runs_the_depth_schedule_with_versions(trained):
    root, run, summary = trained
    assert summary["ok"] and summary["updates"] == 3
    metrics = _metrics(run)
    assert [m["k"] for m in metrics] == [2, 3, 4]
    assert [m["weight_version"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        for key in ("rollout_s", "train_s", "publish_s", "step_s", "job_elapsed_s", "device_hours"):
            assert m[key] >= 0, key
        assert set(m["exit_depth_histogram"]) == {str(m["k"])}
        assert m["logprob_mismatch_max"] < 1e-5  # engine vs trainer replay, fp32 CPU
        assert m["engine_decode_layer_tokens"] > 0 and m["train_layer_tokens_executed"] > 0
        assert 0 < min(m["engine_decode_batch_tenths"]) <= max(m["engine_decode_batch_tenths"]) <= 4  # max-num-seqs
    rows = [json.loads(x) for x in (root / "train.jsonl").read_text().splitlines()]
    labels = {r["metadata"]["problem_id"]: r["label"] for r in rows}
    for update in range(3):
        records = [json.loads(x) for x in (run / "rollouts" / f"update_{update:06d}.jsonl").read_text().splitlines()]
        assert len(records) == 6
        assert all(r["exit_depths"][0] == T for r in records)
        assert all(r["label"] == labels[r["problem_id"]] for r in records)  # the label the reward got
    plan = json.loads((run / "ouro-plan.json").read_text())
    assert plan["next_update"] == 3 and plan["contract"]["depths"] == [2, 3, 4]
    evals = [json.loads(x) for x in (run / "evaluations.jsonl").read_text().splitlines()]
    assert {(e["when"], e["k"]) for e in evals} == {(w, k) for w in ("start", "end") for k in (2, 3, 4)}
    assert (run / "metrics.png").stat().st_size > 0 and (run / "COMPLETE").is_file()
    final_save = json.loads((run / "COMPLETE").read_text())["final_save"]  # after metrics.jsonl's last line
    assert final_save["save_s"] > 0 and final_save["peak_held_save_gib"] is None  # no device peaks on CPU


def test_resume_with_other_depths_is_rejected_naming_depths(trained):
    root, run, _ = trained
    proc = ouro("resume", str(run), "--updates", "5", "--depths", "2", "4", cwd=root)
    assert proc.returncode == 2
    assert "depths" in proc.stderr and "Traceback" not in proc.stderr
    assert len(_metrics(run)) == 3


def test_no_share_prompts_samples_the_same_rollout_and_is_part_of_the_contract(trained, tmp_path):
    """`--no-share-prompts` keeps a prompt copy per sample: the first update samples the tokens,
    depths and logprobs the shared run sampled (same seeds, no preemption on either), the plan
    records the setting, and a resume of the shared run that turns it off is refused naming it."""
    root, run, _ = trained
    other = tmp_path / "copies"
    proc = ouro(
        "train", "--depths", "2", "3", "4", "--updates", "1", "--run-dir", str(other), "--no-share-prompts",
        *small(root), "--eval-data", "", cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "engine: LLM; a prompt K/V copy per sample" in proc.stdout + proc.stderr
    assert json.loads((other / "ouro-plan.json").read_text())["contract"]["share_prompts"] is False
    assert json.loads((run / "ouro-plan.json").read_text())["contract"]["share_prompts"] is True

    def sampled(directory):
        rows = (directory / "rollouts" / "update_000000.jsonl").read_text().splitlines()
        return [(r["response_ids"], r["exit_depths"], r["logprobs"]) for r in map(json.loads, rows)]

    assert sampled(other) == sampled(run)
    before = (run / "ouro-plan.json").read_text()
    proc = ouro("resume", str(run), "--updates", "9", "--no-share-prompts", cwd=root)
    assert proc.returncode == 2, proc.stderr
    assert "error: resume would change share_prompts: the run has True, this invocation False" in proc.stderr
    assert (run / "ouro-plan.json").read_text() == before


def test_resume_continues_and_export_loads(trained):
    root, run, _ = trained
    proc = ouro("resume", str(run), "--updates", "5", cwd=root)
    assert proc.returncode == 0, proc.stderr
    # the summary is the command's product, on stdout; logs and progress on stderr, a line per
    # update, never wrapped off a terminal
    assert "held-out accuracy" in proc.stdout and f"run directory: {run}" in proc.stdout
    logs = proc.stderr.splitlines()
    assert [line.split("  ")[0] for line in logs if line.startswith("update ")] == ["update 4/5", "update 5/5"]
    assert "held-out accuracy" not in proc.stderr and any(line.startswith("memory: ") for line in logs)
    assert max(map(len, logs)) > 80 and not any(" v4 " in line for line in logs)
    metrics = _metrics(run)
    assert [m["update"] for m in metrics] == [0, 1, 2, 3, 4]
    assert [m["k"] for m in metrics] == [2, 3, 4, 2, 3]
    assert [m["weight_version"] for m in metrics] == [1, 2, 3, 4, 5]
    assert json.loads((run / "ouro-plan.json").read_text())["next_update"] == 5

    out = root / "exported"
    proc = ouro("export", str(run), str(out), cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert (out / "COMPLETE").is_file() and (out / "tokenizer.json").is_file() and (out / "modeling_ouro.py").is_file()
    from ouro_cli.model import load

    model = load(out)
    original = load(root / "hf")
    assert model.state_dict().keys() == original.state_dict().keys()
    changed = [n for n, t in model.state_dict().items() if not torch.equal(t, original.state_dict()[n])]
    assert changed and not any("early_exit_gate" in n for n in changed)  # trained, gate frozen
    ids = torch.tensor([[1, 5, 6, 7]])
    assert model(ids).shape == (1, 4, 64)


def test_eval_reports_accuracy_per_k(trained):
    root, run, _ = trained
    out = root / "eval-out"
    proc = ouro(
        "eval",
        str(run),
        "--data",
        str(root / "eval.jsonl"),
        "--depths",
        "1",
        "4",
        "--prompts",
        "3",
        "--reward-function",
        REWARD,
        "--max-response-len",
        "6",
        "--out",
        str(out),
        "--json",
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [e["k"] for e in doc["evaluations"]] == [1, 4]
    assert (out / "COMPLETE").is_file()
    lines = (out / "evaluations.jsonl").read_text().splitlines()
    assert [json.loads(x)["mean_exit_depth"] for x in lines] == [1.0, 4.0]


@pytest.mark.parametrize(
    "content, where",
    [
        ('{"prompt": "1+1=?", "label": 2}\n{"prompt": "2+2=?", "label": 4\n', "bad.jsonl:2"),
        ('{"prompt": "1+1=?", "label": 2}\n{"prompt": "2+2=?"}\n', "bad.jsonl:2"),
        ('{"prompt": "", "label": 2}\n', "bad.jsonl:1"),
    ],
)
def test_malformed_data_fails_before_any_model_loads(tmp_path, content, where):
    (tmp_path / "bad.jsonl").write_text(content)
    # the model path does not exist: reporting the data error proves data is checked first
    proc = ouro(
        "train",
        "--model",
        str(tmp_path / "missing-model"),
        "--data",
        str(tmp_path / "bad.jsonl"),
        "--run-dir",
        str(tmp_path / "run"),
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert where in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoint").exists()


@pytest.mark.parametrize(
    "flag,value,named",
    [
        ("--reward-function", "nowhere.rewards.score", "nowhere.rewards.score"),
        ("--engine", "nowhere.engines:make", "--engine 'nowhere.engines:make'"),
    ],
    ids=["reward", "engine"],
)
def test_unknown_plugin_path_is_named_before_any_model_loads(tmp_path, flag, value, named):
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1+1=?", "label": 2}\n')
    proc = ouro(
        "train",
        "--model",
        str(tmp_path / "missing"),
        "--data",
        str(tmp_path / "ok.jsonl"),
        flag,
        value,
        "--run-dir",
        str(tmp_path / "run"),
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert named in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "given,named",
    [
        ({"OURO_REPLAY_ATTENTION": "bogus"}, "OURO_REPLAY_ATTENTION='bogus': must be one of sdpa, paged"),
        ({"OURO_REPLAY_ATTENTION": "paged"}, "--replay-attention paged runs a Triton kernel"),
        (["--replay-attention", "paged"], "--replay-attention paged runs a Triton kernel"),
        ({"OURO_DECODE_GEMV": "magic"}, "OURO_DECODE_GEMV='magic': must be one of auto, cublas, triton"),
        (["--decode-gemv", "magic"], "--decode-gemv must be auto, cublas or triton, got 'magic'"),
        (["--decode-attention", "triton"], "--decode-attention triton needs CUDA"),
        ({"OURO_COMPILE_LAYERS": "yes"}, "OURO_COMPILE_LAYERS='yes': must be one of auto, on, off"),
        ({"OURO_COMPILE": "1"}, "OURO_COMPILE='1': must be one of auto, off, always"),
    ],
    ids=[
        "replay-value",
        "replay-on-cpu",
        "replay-flag-on-cpu",
        "gemv-value",
        "gemv-flag-value",
        "attention-flag-on-cpu",
        "compile-layers-value",
        "compile-value",
    ],
)
def test_bad_execution_setting_fails_before_anything_runs(tmp_path, given, named):
    """An execution setting, as a flag or as its environment variable, is checked before
    anything runs; the error names the flag or the variable."""
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1+1=?", "label": 2}\n')
    flags, env = (given, {}) if isinstance(given, list) else ([], given)
    proc = ouro(
        "train",
        "--model",
        str(tmp_path / "missing"),
        "--data",
        str(tmp_path / "ok.jsonl"),
        "--device",
        "cpu",
        "--run-dir",
        str(tmp_path / "run"),
        *flags,
        cwd=tmp_path,
        env={**env, "TRITON_INTERPRET": "0"},
    )
    assert proc.returncode == 2
    assert named in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_micro_batch_budget_too_small_for_one_sample_fails_before_any_rollout(tmp_path):
    """--max-tokens-per-micro-batch below the longest prompt + --max-response-len would fail at
    the first long sample, updates into the run: it is refused at the start, naming the figure."""
    bundled = Path(__file__).resolve().parents[2] / "ouro_cli" / "bundled" / "tiny"
    proc = ouro(
        "train",
        "--model",
        str(bundled / "model"),
        "--data",
        str(bundled / "train.jsonl"),
        "--eval-data",
        "",
        "--updates",
        "1",
        "--max-response-len",
        "32",
        "--max-tokens-per-micro-batch",
        "16",
        "--run-dir",
        str(tmp_path / "run"),
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--max-tokens-per-micro-batch 16 is less than one sample can take" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_resume_refuses_another_execution_setting_naming_it(trained, tmp_path):
    """The run's contract holds what its kernel settings select on its device: a resume that
    would select other ones (a flag, or the variable standing in for it) is refused naming the
    setting, and writes nothing (the KV cache's dtype too: a resume uses the run's); one that
    selects the same (cuBLAS projections asked for on a CPU run, where no Triton kernel runs) is
    not refused for it. A plan that does not record
    them is refused, naming `execution`: it is not read as having run under the defaults."""
    root, run, _ = trained
    before = (run / "ouro-plan.json").read_text()
    contract = json.loads(before)["contract"]
    assert contract["execution"] == {
        "compile": "off",
        "compile_layers": "off",
        "decode_attention": "torch",
        "decode_gemv": "cublas",
        "replay_attention": "sdpa",
        "exact": "off",
        "kv_cache_dtype": "model",
    }
    for flags, env in ((["--compile", "always"], {}), ([], {"OURO_COMPILE": "always"})):
        proc = ouro("resume", str(run), "--updates", "9", *flags, cwd=root, env=env)
        assert proc.returncode == 2, proc.stderr
        assert (
            "error: resume would change execution.compile: the run has 'off', this invocation 'on' (set by "
            "--compile or OURO_COMPILE" in proc.stderr
        )
    proc = ouro("resume", str(run), "--updates", "9", "--kv-cache-dtype", "fp8", cwd=root)
    assert proc.returncode == 2, proc.stderr
    assert "error: resume would change execution.kv_cache_dtype: the run has 'model', this invocation 'fp8'" in (
        proc.stderr
    )
    assert (run / "ouro-plan.json").read_text() == before

    old = tmp_path / "old"  # no execution settings in the plan
    shutil.copytree(run, old)
    for plan_file in [old / "ouro-plan.json", *old.glob("checkpoint/iter_*/ouro-plan.json")]:
        plan = json.loads(plan_file.read_text())
        del plan["contract"]["execution"]
        for key in ("compile", "compile_layers", "decode_attention", "decode_gemv", "replay_attention"):
            del plan["options"][key]
        plan_file.write_text(json.dumps(plan))
    proc = ouro("resume", str(old), "--updates", "9", cwd=root)
    assert proc.returncode == 2, proc.stderr
    assert "error: resume would change execution: the run has None, this invocation {" in proc.stderr

    done = json.loads(before)["next_update"]
    proc = ouro("resume", str(run), "--updates", str(done + 1), "--decode-gemv", "cublas", cwd=root)
    assert proc.returncode == 0, proc.stderr  # what runs on CPU anyway


def test_cuda_graphs_without_a_gpu_fail_clearly(tmp_path):
    proc = ouro("train", "--cuda-graphs", "--device", "cpu", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2 and "--cuda-graphs" in proc.stderr and "Traceback" not in proc.stderr


def test_resume_after_a_crash_reruns_unsaved_updates_once(trained, tmp_path):
    """A crash after update 2 was logged but before it was saved: resume continues from the
    checkpoint at 2, re-runs update 2 identically and logs every update exactly once."""
    root = trained[0]
    run = tmp_path / "run"
    shutil.copytree(root / "finished", run)
    before = _metrics(run)
    rollout_2 = (run / "rollouts" / "update_000002.jsonl").read_text()
    # what a crash between logging update 2 and its save leaves behind
    shutil.rmtree(run / "checkpoint" / "iter_0000003")
    (run / "checkpoint" / "latest_checkpointed_iteration.txt").write_text("2\n")
    (run / "COMPLETE").unlink()
    proc = ouro("resume", str(run), "--updates", "4", cwd=root)
    assert proc.returncode == 0, proc.stderr
    after = _metrics(run)
    assert [m["update"] for m in after] == [0, 1, 2, 3]
    assert after[2]["rewards"] == before[2]["rewards"] and after[2]["weight_version"] == 3
    assert (run / "rollouts" / "update_000002.jsonl").read_text() == rollout_2
