"""`ouro train --exact` end to end (docs/exact.md): with the depth schedule 2 3 4 and threshold
exits at mixed depths, every update's engine-vs-trainer mismatch is exactly 0.0, in fp32 and
in bf16; without --exact the bf16 run's is not (the control); the mismatch is reported by
exit depth; `--is-correction` runs and reports what it masked; and `ouro verify-resume
--exact` finds the resumed run bit-identical to the continuous one.

The exact runs carry the pairs rl/combinations.py names them for: the fp32 run trains with
the options of the loss on (two epochs with a clip of ±0.001, which the policy's move reaches
at the second step; the IS weights are exactly 1) and the optimizer state offloaded, a third
samples on PD workers, a fourth does all of that with an fp8 KV cache (the rollouts' packed
K/V cross the PD transport; the plan records the cache and the export notes it), and the
resumed exact run schedules asynchronously and filters groups over mini-batches, its
mismatch exactly 0 too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .harness import run_all
from .test_train_cli import ouro
from .tiny_checkpoint import REWARD, make_checkpoint

pytestmark = pytest.mark.slow

# one mini-batch: the first step, whose mismatch the metrics report, covers every sampled token
TRAINED = [
    "--epochs",
    "2",
    "--is-correction",
    "tis",
    "--clip-ratio-c",
    "3",
    "--loop-weighting",
    "uniform",
    "--advantage",
    "rloo",
    "--overlong",
    "soft",
    "--offload-optimizer",
    "on",
    "--eps-low",
    "0.001",
    "--eps-high",
    "0.001",
]  # a clip the second step's small move reaches
RUNS = {
    "exact-fp32": ["--exact", "--dtype", "fp32", *TRAINED],
    "exact-bf16": ["--exact", "--dtype", "bf16"],
    "exact-pd": [
        "--exact",
        "--dtype",
        "fp32",
        "--prefill-devices",
        "0",
        "--decode-devices",
        "1",
        "--kv-transport",
        "shm",
    ],
    "exact-fp8": [
        "--exact",
        "--dtype",
        "fp32",
        "--kv-cache-dtype",
        "fp8",
        "--prefill-devices",
        "0",
        "--decode-devices",
        "1",
        "--kv-transport",
        "shm",
        *TRAINED,
    ],
    "default-bf16": ["--dtype", "bf16", "--is-correction", "mis", "--is-bounds", "0.999", "1.001"],
}


def options(root: Path) -> list[str]:
    return [
        "--model",
        str(root / "hf"),
        "--data",
        str(root / "train.jsonl"),
        "--eval-data",
        "",
        "--prompts-per-update",
        "2",
        "--group-size",
        "3",
        "--max-response-len",
        "8",
        "--max-num-seqs",
        "4",
        "--depths",
        "2",
        "3",
        "4",
        "--exit-threshold",
        "0.7",
        "--reward-function",
        REWARD,
    ]


def export(root: Path, name: str) -> list[str]:
    """The fp8 run exports its final model (its README says how it was trained)."""
    return ["--export-hf", str(root / name / "hf")] if name == "exact-fp8" else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    make_checkpoint(root, mixed_exits=True)
    names = list(RUNS)
    procs = run_all(
        *[
            ["train", *options(root), "--updates", "3", "--run-dir", str(root / name), *RUNS[name], *export(root, name)]
            for name in names
        ],
        cwd=root,
    )
    for name, proc in zip(names, procs, strict=True):
        assert proc.returncode == 0, f"{name}: {proc.stderr}"
    return root, {
        name: [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()] for name in names
    }


@pytest.mark.parametrize("name", ["exact-fp32", "exact-bf16", "exact-pd", "exact-fp8"])
def test_exact_runs_have_no_mismatch_at_all(runs, name):
    root, metrics = runs
    assert [m["k"] for m in metrics[name]] == [2, 3, 4]
    for m in metrics[name]:
        assert len(m["exit_depth_histogram"]) >= 2, f"update {m['update']}: depths not mixed"
        assert m["logprob_mismatch_max"] == 0.0 and m["logprob_mismatch_mean"] == 0.0, m["update"]
        assert set(m["logprob_mismatch_max_by_depth"].values()) == {0.0}
        assert set(m["exit_depth_histogram"]) <= set(m["logprob_mismatch_mean_by_depth"])
    contract = json.loads((root / name / "ouro-plan.json").read_text())["contract"]
    assert contract["execution"]["exact"] == "on"
    assert contract["execution"]["kv_cache_dtype"] == ("fp8" if name == "exact-fp8" else "model")
    if name == "exact-fp8":
        manifest = json.loads((root / name / "hf" / "manifest.json").read_text())
        assert manifest["options"]["trained_with"] == {"kv_cache_dtype": "fp8"}
        assert "--kv-cache-dtype fp8" in (root / name / "hf" / "README.md").read_text()
    if name in ("exact-fp32", "exact-fp8"):  # two epochs: the second step's ratios are the policy's move alone
        for m in metrics[name]:
            assert m["train_optimizer_steps"] == 2 and m["train_is_weight_mean"] == 1.0
            assert 0 < m["train_clip_fraction"] < 1 and m["train_ratio_max"] > 1.001


def test_default_bf16_mismatches_and_its_correction_masks(runs):
    _, metrics = runs
    for m in metrics["default-bf16"]:
        assert m["logprob_mismatch_max"] > 0.0, m["update"]
        by_depth = m["logprob_mismatch_max_by_depth"]
        assert max(by_depth.values()) == m["logprob_mismatch_max"]
        assert 0.0 < m["train_is_masked_fraction"] <= 1.0
        assert m["train_is_weight_mean"] == pytest.approx(1.0 - m["train_is_masked_fraction"])


def test_verify_resume_is_bit_identical_in_exact_mode(runs):
    root, _ = runs
    work = root / "vr"
    proc = ouro(
        "verify-resume",
        "--updates",
        "3",
        "--resume-at",
        "2",
        "--work-dir",
        str(work),
        *options(root),
        "--exact",
        "--dtype",
        "bf16",
        "--filter-groups",
        "--mini-batches",
        "2",
        "--async-scheduling",
        "--json",
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["identical"] and doc["first_divergence"] is None
    plan = json.loads((work / "resumed" / "ouro-plan.json").read_text())
    assert plan["contract"]["execution"]["exact"] == "on"
    assert (plan["contract"]["async_scheduling"], plan["contract"]["filter_groups"]) == (True, True)
    for line in (work / "resumed" / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        assert m["logprob_mismatch_max"] == 0.0, m["update"]
        assert m["train_optimizer_steps"] + m["train_empty_mini_batches"] == 2, m["update"]
