"""The one output guard (ouro_cli.outputs): no output may equal, contain or lie inside an
input, nor lie inside a run's own files or a Megatron checkpoint; it must be writable;
--overwrite empties only what is not an input; and of two writers of one output the second
is refused instead of replacing the first's result."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ouro_cli import outputs
from ouro_cli.errors import UserError
from ouro_cli.rl.lock import RunLocked
from ouro_cli.rl.run_dir import RunDir


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text("{}\n")
    return [tmp_path / "model", tmp_path / "data.jsonl"]


@pytest.mark.parametrize("out", ["model", "model/sub", ".", "data.jsonl"], ids=["equal", "inside", "contains", "file"])
def test_an_output_overlapping_an_input_is_refused_even_with_overwrite(tmp_path, inputs, out):
    with pytest.raises(UserError, match="overlaps the input") as err:
        outputs.check_output(tmp_path / out, overwrite=True, inputs=inputs)
    assert "\n" not in str(err.value)
    with (
        pytest.raises(UserError, match="overlaps the input"),
        outputs.staged_output(tmp_path / out, overwrite=True, command="test", inputs=inputs),
    ):
        pass
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "data.jsonl").is_file()


def test_a_sibling_output_is_fine_and_overwrite_replaces_it(tmp_path, inputs):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        outputs.check_output(out, overwrite=False, inputs=inputs)
    with outputs.staged_output(out, overwrite=True, command="test", inputs=inputs) as staging:
        (staging / "new").write_text("y")
    assert sorted(p.name for p in out.iterdir()) == ["new"]


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs /sys (not writable even for root)")
def test_an_unwritable_output_is_found_before_anything_is_written():
    # permission bits mean nothing to root: the probe creates a directory for real
    with pytest.raises(UserError, match="cannot be written .*choose a writable directory"):
        outputs.check_output(Path("/sys/ouro-test-output"), overwrite=False)


def test_an_output_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is not a directory"):
        outputs.check_output(tmp_path / "f", overwrite=True)
    with pytest.raises(UserError, match="cannot be created"):
        outputs.check_output(tmp_path / "f" / "out", overwrite=True)


def test_clear_dir_keeps_only_what_it_is_told(tmp_path):
    for name in ("a", "ouro.lock"):
        (tmp_path / name).write_text(name)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    outputs.clear_dir(tmp_path, keep=["ouro.lock"])
    assert [p.name for p in tmp_path.iterdir()] == ["ouro.lock"]


@pytest.fixture
def run(tmp_path):
    """A run directory (its plan is what makes it one) with records and a checkpoint."""
    run = tmp_path / "run"
    for name in ("rollouts", "checkpoint/iter_0000001", "logs"):
        (run / name).mkdir(parents=True)
    for name in (
        "ouro-plan.json",
        "metrics.jsonl",
        "checkpoint/latest_checkpointed_iteration.txt",
        "checkpoint/iter_0000001/COMPLETE",
    ):
        (run / name).write_text("1\n")
    return run


@pytest.mark.parametrize(
    "inside",
    [
        "rollouts",
        "rollouts/new",
        "checkpoint",
        "checkpoint/iter_0000001",
        "checkpoint/iter_0000003",
        "checkpoint/latest_checkpointed_iteration.txt",
        "metrics.jsonl",
        "ouro-plan.json",
        "logs/x",
        "COMPLETE",
    ],
)
def test_an_output_inside_a_run_s_own_files_is_refused_even_with_overwrite(run, inside):
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(UserError, match=rf"lies inside the run directory {run} \(\S+ is the run's own\)") as err:
        outputs.check_output(run / inside, overwrite=True)
    assert "\n" not in str(err.value)
    with (
        pytest.raises(UserError, match="lies inside the run directory"),
        outputs.staged_output(run / inside, overwrite=True, command="test"),
    ):
        pass
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # not even a lock file


def test_a_new_name_in_a_run_and_a_run_that_does_not_exist_yet(run, tmp_path):
    outputs.check_output(run / "hf", overwrite=False)  # where --export-hf of the run goes
    future = RunDir(tmp_path / "future")  # the command's own run, not yet created
    with pytest.raises(UserError, match="lies inside the run directory .*future"):
        outputs.check_output(future.rollouts, overwrite=True, runs=[future])


def test_an_output_inside_a_megatron_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "release").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("release\n")
    for inside in ("iter_0000005", "hf_assets/x"):
        with pytest.raises(UserError, match=f"lies inside the Megatron checkpoint {ckpt}"):
            outputs.check_output(ckpt / inside, overwrite=True)


def test_a_second_writer_of_one_output_is_refused_and_the_first_publishes(tmp_path):
    out = tmp_path / "out"
    with outputs.staged_output(out, command="ouro export") as staging:
        with pytest.raises(RunLocked, match=rf"{out} is in use by pid {os.getpid()} .*\(ouro export, since"):
            with outputs.staged_output(out, command="ouro export"):
                pass
        (staging / "model.safetensors").write_text("first")
    assert (out / "model.safetensors").read_text() == "first"
    with pytest.raises(UserError, match="is not empty; choose another or pass --overwrite"):
        with outputs.staged_output(out, command="ouro export"):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock, no staging left


def test_a_writer_that_went_round_the_guard_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UserError, match="was written by another process meanwhile"):
        with outputs.staged_output(out, command="ouro export") as staging:
            (staging / "mine").write_text("x")
            out.mkdir()
            (out / "theirs").write_text("y")
    assert [p.name for p in out.iterdir()] == ["theirs"]


def test_a_file_output(tmp_path):
    out = tmp_path / "plot.png"
    with (
        outputs.claimed_output(out, overwrite=False, command="ouro plot", file=True) as output,
        output.staged() as staging,
    ):
        assert staging.suffix == ".png" and staging.parent == tmp_path
        staging.write_text("png")
    assert out.read_text() == "png"
    with pytest.raises(UserError, match=f"output {out} exists; choose another or pass --overwrite"):
        outputs.check_output(out, overwrite=False, file=True)
    with pytest.raises(UserError, match="exists and is a directory"):
        outputs.check_output(tmp_path, overwrite=True, file=True)
