"""Save at step M, load in a fresh process, continue to N: bit-identical to a continuous
N-step run (fp32 CPU; plain and distributed optimizer). A save killed before its commit
leaves the previous iteration as latest, and it loads. Checkpoint keys are HF names."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from _subprocess import python

from ouro_cli.checkpoint import layout

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    first = python("_resume_worker.py", "first", str(out))
    assert first.returncode == -signal.SIGKILL, first.stdout[-4000:]  # killed inside the last save, as planned
    assert (out / "about_to_kill").exists(), first.stdout[-4000:]
    second = python("_resume_worker.py", "resume", str(out))
    assert second.returncode == 0, second.stdout[-4000:]
    return out


def load(path):
    return torch.load(path, weights_only=False)


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("variant", ["fp32", "distopt", "bf16"])
def test_resume_is_bitwise_identical_to_a_continuous_run(runs, variant):
    continuous, resumed = load(runs / f"{variant}_continuous.pt"), load(runs / f"{variant}_resumed.pt")
    kinds = {key.split("/")[0] for key in continuous}
    assert {"param", "main", "adam", "lr", "scheduler", "rng"} <= kinds
    assert any(k.endswith(".exp_avg") for k in continuous) and any(k.endswith(".exp_avg_sq") for k in continuous)
    steps = {float(v) for k, v in continuous.items() if k.endswith(".step")}
    assert steps == {4.0}
    assert continuous["scheduler"]["num_steps"] == 4
    assert all(v.dtype == torch.float32 for k, v in continuous.items() if k.startswith("main/"))
    param_dtype = torch.bfloat16 if variant == "bf16" else torch.float32
    assert continuous["param/lm_head.weight"].dtype == param_dtype
    assert_bitwise_equal(continuous, resumed)


def test_keep_last_prunes_older_iterations(runs):
    assert layout.read_tracker(runs / "fp32") == 2
    assert sorted(p.name for p in (runs / "fp32").glob("iter_*")) == ["iter_0000002"]


def test_killed_save_leaves_the_previous_iteration_latest(runs):
    root = runs / "fault"
    assert layout.read_tracker(root) == 1
    assert layout.latest_iteration_dir(root).name == "iter_0000001"
    assert not (root / "iter_0000002").exists()  # only its staging directory was written
    report = json.loads((runs / "resume.json").read_text())
    assert report["fault_extra"] == {"next_step": 1}
    assert_bitwise_equal(load(runs / "fault_iter1.pt"), load(runs / "fault_loaded.pt"))


def test_model_keys_in_the_checkpoint_are_the_physical_hf_names(runs):
    report = json.loads((runs / "resume.json").read_text())
    names = set(report["model_names"])
    assert "model.early_exit_gate.weight" in names and "lm_head.weight" in names
    assert names <= set(report["checkpoint_keys"])
    assert (runs / "fp32" / layout.HF_ASSETS / "config.json").is_file()
    # `ouro_cli.model.load` (through ouro_cli.checkpoint) reads the trainer's weights bit for bit.
    assert report["model_reads_back"] == {"fp32": True, "distopt": True, "bf16": True}
