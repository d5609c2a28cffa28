"""Readers and the pruner (ouro_cli.checkpoint.layout): an iteration a reader has pinned
outlives `--keep-last` until the reader lets go, and a reader whose iteration is pruned
before it pins it reads the next latest."""

from __future__ import annotations

import shutil

from ouro_cli.checkpoint import layout


def _save(root, iteration: int, keep_last: int = 1):
    layout.staging_dir(root, iteration)
    return layout.commit_iteration(root, iteration, keep_last=keep_last)


def _iterations(root) -> list[str]:
    return sorted(p.name for p in root.glob("iter_*"))


def test_keep_last_never_removes_an_iteration_a_reader_holds(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 1)
    path, pin = layout.pin_latest(root)
    assert path == root / "iter_0000001" and pin is not None
    _save(root, 2)  # --keep-last 1 would remove iter_1 now
    assert _iterations(root) == ["iter_0000001", "iter_0000002"] and (path / "COMPLETE").is_file()
    again, second = layout.pin_latest(root)  # a reader that comes now reads the latest
    assert again == root / "iter_0000002"
    second.release()
    pin.release()
    _save(root, 3)  # the next save's prune removes what no one holds any more
    assert _iterations(root) == ["iter_0000003"]


def test_a_reader_whose_iteration_is_pruned_before_it_pins_it_reads_the_next_latest(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    for iteration in (1, 2):
        _save(root, iteration, keep_last=2)
    chosen = []
    latest = layout.latest_iteration_dir

    def pruned_under_the_reader(where):
        path = latest(where)
        if not chosen:  # the first choice is pruned before the reader opens it
            shutil.rmtree(path)
            (root / layout.TRACKER).write_text("1\n")
        chosen.append(path.name)
        return path

    monkeypatch.setattr(layout, "latest_iteration_dir", pruned_under_the_reader)
    path, pin = layout.pin_latest(root)
    assert chosen == ["iter_0000002", "iter_0000001"] and path == root / "iter_0000001" and pin is not None


def test_an_iteration_from_before_readers_pinned_is_read_unpinned(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 1)
    (root / "iter_0000001" / layout.READERS).unlink()
    assert layout.pin_latest(root) == (root / "iter_0000001", None)
