"""A save that cannot succeed fails in one line naming its cause, and leaves nothing behind.

On a small tmpfs (root mounts one; CI runs as root): a disk too small for the checkpoint
is refused before anything is written; a write that runs out of space part-way (the
size estimate made to miss) names the full disk, removes its staging directory and
leaves the previous iteration latest and loadable. A read-only directory names the
permission.
"""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import pytest
import torch

from ouro_cli.checkpoint import layout
from ouro_cli.errors import ResourceError
from ouro_cli.model import build, tiny_config
from tests.tmpfs import tmpfs

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def trainer():
    """A trainer that has taken one step (Adam state exists, as in any saved run)."""
    from _trainer_samples import make_samples

    from ouro_cli.trainer import Trainer, TrainerConfig

    model = build(tiny_config(), seed=3)
    with Trainer(copy.deepcopy(model), TrainerConfig(device="cpu", lr=1e-3)) as t:
        t.train_step(make_samples(model, 4, seed=1))
        yield t


def fill(directory: Path, leave: int) -> None:
    """Write a file that leaves about `leave` bytes free on `directory`'s filesystem."""
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    with open(directory / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def test_too_small_a_disk_is_refused_before_writing(trainer):
    with tmpfs("4m") as mount:
        root = mount / "ckpt"
        with pytest.raises(ResourceError) as err:
            trainer.save(root, 1)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith("not enough disk space to save checkpoint iter_0000001: it needs about")
        assert "GiB free" in message and message.endswith("(no earlier checkpoint exists)")  # none to keep
        assert not root.exists() or not any(root.iterdir())  # nothing was written


def test_a_full_disk_mid_save_names_it_and_keeps_the_last_checkpoint(trainer, monkeypatch):
    from ouro_cli.trainer import checkpointing

    monkeypatch.setattr(checkpointing, "SAVE_MARGIN_BYTES", 0)
    with tmpfs("24m") as mount:
        root = mount / "ckpt"
        trainer.save(root, 1, extra={"next_update": 1})
        size = sum(f.stat().st_size for f in (root / "iter_0000001").rglob("*") if f.is_file())
        fill(mount, leave=size // 3)  # the next save passes the check (estimate made to miss), then runs out
        monkeypatch.setattr(checkpointing, "checkpoint_bytes", lambda module, optimizer: 0)
        with pytest.raises(ResourceError) as err:
            trainer.save(root, 2, extra={"next_update": 2})
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith("saving checkpoint iter_0000002 failed: ")
        assert "disk" in message and "the last checkpoint is intact" in message
        assert not (root / "iter_0000002.staging").exists() and not (root / "iter_0000002").exists()
        assert layout.read_tracker(root) == 1
        before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
        assert trainer.load(root) == {"next_update": 1}
        assert all(torch.equal(before[n], p) for n, p in trainer.module.named_parameters())


def test_a_read_only_directory_names_the_permission(trainer, tmp_path):
    if os.geteuid() == 0:
        # root writes through permission bits; a read-only mount stops it
        with tmpfs("64m") as mount:
            root = mount / "ckpt"
            root.mkdir()
            subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
            with pytest.raises(ResourceError, match="saving checkpoint iter_0000001 failed: permission denied"):
                trainer.save(root, 1)
    else:
        root = tmp_path / "ckpt"
        root.mkdir()
        root.chmod(0o500)
        with pytest.raises(ResourceError, match="saving checkpoint iter_0000001 failed: permission denied"):
            trainer.save(root, 1)


def test_ouro_train_on_a_full_disk_exits_1_with_one_line():
    import sys

    with tmpfs("4m") as mount:
        run = mount / "run"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ouro_cli.cli.app",
                "train",
                "--updates",
                "1",
                "--eval-prompts",
                "4",
                "--prompts-per-update",
                "2",
                "--group-size",
                "2",
                "--run-dir",
                str(run),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 1, done.stderr[-3000:]
        assert len(errors) == 1 and "not enough disk space to save checkpoint iter_0000001" in errors[0], done.stderr
        assert errors[0].endswith("(no earlier checkpoint exists)") and "intact" not in errors[0]
        assert "Traceback" not in done.stderr
        assert not list((run / "checkpoint").glob("iter_*"))


def test_a_background_save_commits_at_finish_and_a_failed_one_names_the_disk(trainer, monkeypatch):
    """`async_save`: the tracker moves only when the save is finished; a background write that
    runs out of space fails at the finish in one line and leaves the previous iteration."""
    from ouro_cli.trainer import checkpointing

    monkeypatch.setattr(trainer.config, "async_save", True)
    monkeypatch.setattr(checkpointing, "SAVE_MARGIN_BYTES", 0)
    with tmpfs("24m") as mount:
        root = mount / "ckpt"
        assert trainer.save(root, 1, extra={"next_update": 1}) is None  # scheduled, not committed
        assert not layout.is_megatron_checkpoint(root) or layout.read_tracker(root) != 1
        assert trainer.wait_for_save() == root / "iter_0000001"
        assert layout.read_tracker(root) == 1 and trainer.wait_for_save() is None
        size = sum(f.stat().st_size for f in (root / "iter_0000001").rglob("*") if f.is_file())
        fill(mount, leave=size // 3)
        monkeypatch.setattr(checkpointing, "checkpoint_bytes", lambda module, optimizer: 0)
        try:  # the write may fail while being scheduled already, or in the background
            trainer.save(root, 2, extra={"next_update": 2})
            trainer.wait_for_save()
        except ResourceError as err:
            message = str(err)
        else:
            pytest.fail("the background save into a full disk did not fail")
        assert message.startswith("saving checkpoint iter_0000002 failed: ") and "\n" not in message
        assert "disk" in message
        assert not (root / "iter_0000002.staging").exists() and not (root / "iter_0000002").exists()
        assert layout.read_tracker(root) == 1
        assert trainer.load(root) == {"next_update": 1}
