"""The Megatron checkpoint directory layout, and what makes an iteration valid.

    CKPT/
      latest_checkpointed_iteration.txt   "7" or "release"; rewritten atomically last
      iter_0000007/                       one megatron dist checkpoint per saved iteration
        COMPLETE                          written after the dist checkpoint and extras
      release/                            the same, for converted (not trained) weights
      hf_assets/                          config.json, tokenizer files, remote code (*.py)

Invariant: an iteration is valid only when its directory has the `COMPLETE` marker. A
save writes `iter_N.staging/` first, marks it complete, renames it to `iter_N/`, and only
then points the tracker at it, so a process killed at any moment leaves the previous
latest iteration loadable. The latest iteration is the one the tracker names, or a newer
complete numbered one: a process killed between the rename and the tracker write (for
a first save: with no tracker at all) leaves a whole iteration the tracker does not name
yet, and it is the latest (`repair_tracker` then points the tracker at it). Older
iterations are pruned only after the tracker has moved.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ouro_cli.artifacts import MARKER, mark_complete
from ouro_cli.errors import UserError
from ouro_cli.testing import faults

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
HF_ASSETS = "hf_assets"


def iteration_dir_name(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def is_megatron_checkpoint(path: Path) -> bool:
    """A tracker, or a complete numbered iteration the tracker was never written for."""
    return (Path(path) / TRACKER).is_file() or bool(complete_iterations(path))


def complete_iterations(root: Path) -> list[int]:
    """The numbered iterations under `root` that carry the COMPLETE marker, oldest first."""
    return sorted(int(p.name[len("iter_"):]) for p in Path(root).glob("iter_???????")
                  if p.name[len("iter_"):].isdigit() and (p / MARKER).is_file())


def read_tracker(root: Path) -> int | str:
    text = (Path(root) / TRACKER).read_text().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError as err:
        raise UserError(f"{root / TRACKER} holds {text!r}, expected an iteration number or 'release'") from err


def latest_iteration(root: Path) -> int | str:
    """The latest complete iteration (see the invariant above), or a UserError saying why there is none."""
    root = Path(root)
    complete = complete_iterations(root)
    if not (root / TRACKER).is_file():
        if not complete:
            raise UserError(f"{root} is not a Megatron checkpoint (no {TRACKER})")
        return complete[-1]
    tracked = read_tracker(root)
    if tracked != RELEASE and complete and complete[-1] > tracked:
        return complete[-1]
    if not (root / iteration_dir_name(tracked) / MARKER).is_file():
        raise UserError(f"{root / iteration_dir_name(tracked)} is incomplete (no {MARKER} marker); "
                        "the checkpoint cannot be trusted")
    return tracked


def latest_iteration_dir(root: Path) -> Path:
    """The directory of the latest complete iteration, or a UserError saying why there is none."""
    return Path(root) / iteration_dir_name(latest_iteration(root))


def repair_tracker(root: Path) -> int | str | None:
    """Point the tracker at the latest complete iteration when it lags behind (an interrupted
    save's last step); returns that iteration when the tracker was rewritten, else None."""
    root = Path(root)
    latest = latest_iteration(root)
    if (root / TRACKER).is_file() and read_tracker(root) == latest:
        return None
    _write_tracker(root, latest)
    return latest


def staging_dir(root: Path, iteration: int | str) -> Path:
    path = Path(root) / (iteration_dir_name(iteration) + ".staging")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def commit_iteration(root: Path, iteration: int | str, keep_last: int | None = None) -> Path:
    """Publish a fully written staging directory as iteration `iteration` and make it latest."""
    root = Path(root)
    staging = root / (iteration_dir_name(iteration) + ".staging")
    faults.point("save.staged")
    mark_complete(staging)
    final = root / iteration_dir_name(iteration)
    if final.exists():  # re-saving the same iteration: move the old one aside first
        old = root / (final.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    _fsync_dir(root)
    faults.point("save.renamed")
    _write_tracker(root, iteration)
    faults.point("save.tracker")
    if keep_last is not None:
        prune(root, keep_last)
    return final


def _write_tracker(root: Path, iteration: int | str) -> None:
    tmp = root / (TRACKER + ".tmp")
    tmp.write_text(f"{iteration}\n")
    os.replace(tmp, root / TRACKER)
    _fsync_dir(root)


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest `keep_last` numbered iterations (never the latest one)."""
    latest = read_tracker(root)
    numbered = sorted(p for p in Path(root).glob("iter_???????") if p.is_dir())
    for path in numbered[: max(0, len(numbered) - keep_last)]:
        if path.name != iteration_dir_name(latest):
            shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
