"""The rollout's out-of-memory recovery on a real allocation failure (rl/recovery.py): a
test-only fault (`generate@1=HOG-N`, ouro_cli/testing/faults.py) takes all the GPU's free
memory but N GiB just before update 0's rollout, as another process would, so the KV cache
the plan sized cannot be mapped. The run halves its cache until the call fits, records the
decision, and a fresh-process resume replays it bit for bit. The model has Ouro-1.4B's width
and two layers, so the cache it wants is tens of GiB while it builds in seconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_train_cli import ouro

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

LEFT_GIB = 8  # what the hog leaves: less than the plan's cache for this shape, more than a quarter of it


def test_a_real_out_of_memory_in_a_rollout_is_survived_and_replayed(tmp_path):
    from convert import write_random_hf
    from e2e import full_size_tokenizer
    from workloads import prompt_lengths, write_prompts

    model = tmp_path / "model"
    write_random_hf(model, seed=0, layers=2)
    full_size_tokenizer(model)
    write_prompts(tmp_path / "data.jsonl", prompt_lengths("p100", 128))
    work = tmp_path / "vr"
    proc = ouro(
        "verify-resume",
        "--updates",
        "2",
        "--resume-at",
        "1",
        "--work-dir",
        str(work),
        "--model",
        str(model),
        "--data",
        str(tmp_path / "data.jsonl"),
        "--eval-data",
        "",
        "--prompts-per-update",
        "64",
        "--group-size",
        "8",
        "--max-response-len",
        "512",
        "--depths",
        "4",
        "--reward-function",
        "ouro_cli.rl.rewards.boxed_answer",
        "--json",
        cwd=tmp_path,
        env={"OURO_TEST_FAULT": f"generate@1=HOG-{LEFT_GIB}"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout)["identical"], proc.stdout
    for run in ("reference", "resumed"):
        plan = json.loads((work / run / "ouro-plan.json").read_text())
        decisions = plan["memory_decisions"]
        assert decisions and all(d["update"] == 0 and d["phase"] == "rollout" for d in decisions), decisions
        assert decisions[-1]["kv_blocks"] < plan["sizing"]["kv_blocks"]
        metrics = [json.loads(x) for x in (work / run / "metrics.jsonl").read_text().splitlines()]
        assert metrics[0]["memory_decisions"] == decisions and metrics[1]["memory_decisions"] == []
        print(run, decisions, [m.get("engine_preemptions") for m in metrics], [m["step_s"] for m in metrics])
