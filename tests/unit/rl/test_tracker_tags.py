"""Tracker tag names: every scalar under one of six groups, and no series that the run's
configuration keeps at zero (rl/tracker_tags.py); the W&B run id a resume continues."""

from __future__ import annotations

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl.loggers import Trackers, wandb_run_id
from ouro_cli.rl.options import TrainOptions, resolve
from ouro_cli.rl.run_dir import RunDir
from ouro_cli.rl.tracker_tags import GROUPS, NOT_LOGGED, left_out, tag

NAMES = {
    "reward_mean": "reward/mean",
    "reward_mean/K=3": "reward/mean/K=3",
    "train_loss": "train/loss",
    "train_grad_norm": "train/grad_norm",
    "train_loop_logprob_mean/t=2": "train/loop_logprob_mean/t=2",
    "logprob_mismatch_mean/depth=2": "train/logprob_mismatch_mean/depth=2",
    "train_forward_backward_s": "timing/train_forward_backward_s",
    "rollout_s": "timing/rollout_s",
    "engine_prefill_us": "timing/engine_prefill_us",
    "engine_graph_capture_ms": "timing/engine_graph_capture_ms",
    "device_hours": "timing/device_hours",
    "peak_memory_train_gib": "memory/peak_memory_train_gib",
    "train_alloc_retries": "memory/train_alloc_retries",
    "memory_outside_gib": "memory/outside_gib",
    "graph_pools_gib": "memory/graph_pools_gib",
    "peak_held_evaluation_gib": "memory/peak_held_evaluation_gib",
    "evaluation_s": "timing/evaluation_s",
    "engine_decode_tokens": "rollout/engine_decode_tokens",
    "mean_exit_depth/K=2": "rollout/mean_exit_depth/K=2",
    "truncations": "rollout/truncations",
    "groups_trained": "rollout/groups_trained",
    "exit_depth": "rollout/exit_depth",
    "eval/pass@2/K=4": "eval/pass@2/K=4",
}


@pytest.mark.parametrize("key", sorted(NAMES))
def test_each_figure_is_named_under_its_group(key):
    assert tag(key) == NAMES[key] and tag(key).split("/")[0] in GROUPS


class Writer:
    """SummaryWriter's calls, recorded."""

    def __init__(self) -> None:
        self.scalars: dict[str, list[tuple[int, float]]] = {}
        self.histograms: list[str] = []

    def add_scalar(self, key, value, step):
        self.scalars.setdefault(key, []).append((step, value))

    def add_histogram(self, key, values, step, bins):
        self.histograms.append(key)

    def flush(self):
        pass


RECORD = {
    "update": 3,
    "k": 2,
    "weight_version": 4,
    "ranks": 1,
    "params_identical_across_ranks": True,
    "reward_mean": 0.5,
    "truncations": 0,
    "train_loss": 0.1,
    "train_logprob_mismatch_mean": 1e-7,
    "logprob_mismatch_mean": 1e-7,
    "train_overlong_masked": 0,
    "train_is_masked_fraction": 0.0,
    "rollout_s": 1.5,
    "rollout_compile_s": 0.0,
    "compile_s": 0.0,
    "refill_s": 1e-6,
    "groups_filtered": 0,
    "engine_spec_draft_tokens": 0,
    "engine_graph_captures": 0,
    "engine_decode_forward_gpu_us": 0,
    "peak_memory_train_gib": None,
    "exit_depth_histogram": {"2": 3},
}


def test_the_configuration_decides_which_zero_counters_are_left_out():
    writer = Writer()
    Trackers(writer, None, left_out(TrainOptions(), "cpu")).update(RECORD)
    assert set(writer.scalars) == {
        "reward/mean",
        "reward/mean/K=2",
        "rollout/k",
        "rollout/truncations",  # zero this update, not zero by configuration
        "train/loss",
        "train/logprob_mismatch_mean",
        "train/logprob_mismatch_mean/K=2",
        "timing/rollout_s",
    }
    assert writer.scalars["reward/mean"] == [(3, 0.5)] and writer.histograms == ["rollout/exit_depth"]
    every = TrainOptions.from_dict(
        {
            "speculative_tokens": 2,
            "filter_groups": True,
            "overlong": "mask",
            "is_correction": "mis",
            "compile": "auto",
        }
    )
    skipped = left_out(every, "cuda")
    assert not any(skipped(key) for key in RECORD if key not in NOT_LOGGED)
    assert skipped("train_logprob_mismatch_mean") and skipped("params_identical_across_ranks")
    always = TrainOptions.from_dict({"compile": "always"})
    assert not left_out(always, "cpu")("compile_s") and left_out(TrainOptions(), "cpu")("train_compile_s")


def test_the_wandb_run_id_is_kept_for_a_resume(tmp_path):
    run = RunDir(tmp_path / "run")
    first = wandb_run_id(run, resume=False)
    assert run.wandb_id.read_text() == first + "\n" and len(first) == 8 and first.isalnum()
    assert wandb_run_id(run, resume=True) == first
    assert wandb_run_id(run, resume=False) != first  # a run started over is another W&B run
    assert wandb_run_id(RunDir(tmp_path / "old"), resume=True)  # a run from before the id file: a new id


def test_wandb_options_need_the_wandb_logger():
    with pytest.raises(UserError, match="^--wandb-project, --wandb-tag are for --logger wandb; pass --logger wandb"):
        resolve({"wandb_project": "p", "wandb_tags": ["a"]}, None)
    with pytest.raises(UserError, match="^--wandb-name is for --logger wandb; .*, or drop it$"):
        resolve({"wandb_name": "n"}, None)
