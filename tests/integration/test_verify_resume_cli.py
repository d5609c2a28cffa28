"""`ouro verify-resume`: a real fresh-process resume is bit-identical (exit 0), and a
deliberately broken one (sampler reseeded after load) is caught (exit 1) with the
first divergence named."""

from __future__ import annotations

import json

import pytest

from .test_train_cli import ouro
from .tiny_checkpoint import REWARD, make_checkpoint

pytestmark = pytest.mark.slow


def test_verify_resume_passes_and_catches_a_broken_resume(tmp_path):
    make_checkpoint(tmp_path)
    opts = [
        "--model",
        str(tmp_path / "hf"),
        "--data",
        str(tmp_path / "train.jsonl"),
        "--eval-data",
        str(tmp_path / "eval.jsonl"),
        "--prompts-per-update",
        "2",
        "--group-size",
        "3",
        "--max-response-len",
        "6",
        "--eval-prompts",
        "2",
        "--max-num-seqs",
        "4",
        "--depths",
        "2",
        "3",
        "4",
        "--exit-threshold",
        "0.9",
        "--reward-function",
        REWARD,
    ]
    work = tmp_path / "vr"
    proc = ouro(
        "verify-resume", "--updates", "4", "--resume-at", "2", "--work-dir", str(work), *opts, "--json", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["identical"] and doc["first_divergence"] is None
    names = {c["name"]: c for c in doc["categories"]}
    assert names["checkpoint tensors"]["compared"] > 20 and names["rollouts"]["compared"] == 4 * 6
    assert names["state hashes"]["compared"] == 4
    assert (work / "report.json").is_file()
    # the reference's checkpoint gave way to its digest; the resumed run kept one iteration
    assert (work / "reference" / "checkpoint_digest.json").is_file() and not (
        work / "reference" / "checkpoint"
    ).exists()
    assert [p.name for p in (work / "resumed" / "checkpoint").glob("iter_*")] == ["iter_0000004"]

    broken = tmp_path / "broken"  # its resume reseeds the sampler (ouro_cli/testing/faults.py)
    for args, env in (
        (["train", *opts, "--updates", "2", "--state-digest", "--run-dir", str(broken)], {}),
        (["resume", str(broken), "--updates", "4"], {"OURO_TEST_BREAK_RESUME": "1"}),
    ):
        step = ouro(*args, cwd=tmp_path, env=env)
        assert step.returncode == 0, step.stderr
    proc = ouro("verify-resume", "--compare", str(work / "reference"), str(broken), "--json", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert not doc["ok"] and not doc["identical"]
    first = doc["first_divergence"]
    assert first["category"] == "rollouts" and first["update"] == 2 and first["sample"] == 0
    assert "first divergence" in proc.stderr and "Traceback" not in proc.stderr


def test_verify_resume_checks_the_disk_before_it_starts(tmp_path):
    """A work directory on a disk too small for two checkpoints is refused before any run."""
    import pytest

    from tests.tmpfs import tmpfs

    make_checkpoint(tmp_path)
    with tmpfs("1m") as mount:
        proc = ouro(
            "verify-resume",
            "--updates",
            "2",
            "--resume-at",
            "1",
            "--work-dir",
            str(mount / "vr"),
            "--model",
            str(tmp_path / "hf"),
            "--data",
            str(tmp_path / "train.jsonl"),
            cwd=tmp_path,
        )
        if proc.returncode == 0:
            pytest.fail("verify-resume ran on a 1 MiB disk")
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and len(errors) == 1, proc.stderr
        assert "verify-resume needs about" in errors[0] and "GiB of disk" in errors[0]
        assert not (mount / "vr" / "reference").exists()


def test_background_saves_and_a_cosine_schedule_resume_bit_identically(tmp_path):
    """`--async-save` with a save after every update: each checkpoint is written while the next
    update runs, and the fresh-process resume still repeats the continuous run bit for bit. The
    run's LR is a cosine that decays over --lr-decay-updates, fixed when the run starts (default:
    its --updates) and kept by a resume to more updates: verify-resume's first leg, stopped at M,
    plans the reference's N, so the LRs, and with them every bit, agree."""
    make_checkpoint(tmp_path)
    opts = [
        "--model",
        str(tmp_path / "hf"),
        "--data",
        str(tmp_path / "train.jsonl"),
        "--eval-data",
        "",
        "--prompts-per-update",
        "2",
        "--group-size",
        "3",
        "--max-response-len",
        "6",
        "--depths",
        "2",
        "4",
        "--reward-function",
        REWARD,
        "--async-save",
        "--save-interval",
        "1",
        "--lr-schedule",
        "cosine",
        "--min-lr",
        "1e-5",
    ]
    work = tmp_path / "vr"
    proc = ouro(
        "verify-resume", "--updates", "3", "--resume-at", "1", "--work-dir", str(work), *opts, "--json", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["identical"]
    names = {c["name"]: c for c in doc["categories"]}
    assert names["state hashes"]["compared"] == 3 and names["checkpoint tensors"]["compared"] > 20
    lrs = [json.loads(x)["train_lr"] for x in (work / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert lrs[0] == 1e-4 and lrs[0] > lrs[1] > lrs[2] > 1e-5  # decaying over 3 updates, not over 1
    plan = json.loads((work / "resumed" / "ouro-plan.json").read_text())
    assert plan["options"]["lr_decay_updates"] == 3


def test_mini_batches_and_filtered_refills_resume_bit_identically(tmp_path):
    """`--mini-batches 2 --filter-groups`: each update takes two optimizer steps (and a warmup counted
    in them) on groups that refill rounds drew past the dropped ones; the data cursor and the LR
    schedule carry that over a fresh-process resume bit for bit, with every option of the loss
    on at once (`--is-correction tis`, whose first-policy forward runs before each update's first
    step, the dual clip, rloo, the soft length penalty, loop weighting), threshold exits and the
    optimizer state offloaded between steps. A resume that would change these options is
    refused, naming the option."""
    import pytest

    from .tiny_checkpoint import BINARY_REWARD

    make_checkpoint(tmp_path)
    opts = [
        "--model",
        str(tmp_path / "hf"),
        "--data",
        str(tmp_path / "train.jsonl"),
        "--eval-data",
        "",
        "--prompts-per-update",
        "3",
        "--group-size",
        "3",
        "--max-response-len",
        "6",
        "--depths",
        "2",
        "3",
        "4",
        "--reward-function",
        BINARY_REWARD,
        "--mini-batches",
        "2",
        "--filter-groups",
        "--max-refill",
        "4",
        "--warmup-steps",
        "2",
        "--is-correction",
        "tis",
        "--clip-ratio-c",
        "3",
        "--advantage",
        "rloo",
        "--overlong",
        "soft",
        "--loop-weighting",
        "progressive",
        "--exit-threshold",
        "0.9",
        "--offload-optimizer",
        "on",
    ]
    work = tmp_path / "vr"
    proc = ouro(
        "verify-resume", "--updates", "4", "--resume-at", "2", "--work-dir", str(work), *opts, "--json", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["identical"]
    lines = [json.loads(x) for x in (work / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["refill_rounds"] for m in lines) > 0 and all(m["train_optimizer_steps"] == 2 for m in lines)
    names = {c["name"]: c for c in doc["categories"]}
    assert names["rollouts"]["compared"] == 3 * sum(m["prompts_drawn"] for m in lines) > 4 * 9  # group size 3
    # the warmup of 2 updates is 4 optimizer steps: LR 0, 1/4, 1/2, 3/4 of --lr, then --lr
    assert [lr for m in lines for lr in m["train_lrs"]][:5] == pytest.approx([0.0, 2.5e-5, 5e-5, 7.5e-5, 1e-4])
    for flag, key in (
        (["--mini-batches", "1"], "mini_batches"),
        (["--epochs", "2"], "epochs"),
        (["--loop-weighting", "uniform"], "loop_weighting"),
    ):
        refused = ouro("resume", str(work / "resumed"), "--updates", "5", *flag, cwd=tmp_path)
        assert refused.returncode == 2 and f"resume would change {key}:" in refused.stderr, refused.stderr
