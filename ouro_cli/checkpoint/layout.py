"""The Megatron checkpoint directory layout, and what makes an iteration valid.

    CKPT/
      latest_checkpointed_iteration.txt   "7" or "release"; rewritten atomically last
      iter_0000007/                       one megatron dist checkpoint per saved iteration
        COMPLETE                          written after the dist checkpoint and extras
      release/                            the same, for converted (not trained) weights
      hf_assets/                          config.json, tokenizer files, remote code (*.py)

Invariant: an iteration is valid only when its directory has the `COMPLETE` marker and
`latest_checkpointed_iteration.txt` names it. A save writes `iter_N.staging/` first,
marks it complete, renames it to `iter_N/`, and only then points the tracker at it, so a
process killed at any moment leaves the previous latest iteration loadable. Older
iterations are pruned only after the tracker has moved.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ouro_cli.artifacts import MARKER, mark_complete
from ouro_cli.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
HF_ASSETS = "hf_assets"


def iteration_dir_name(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def is_megatron_checkpoint(path: Path) -> bool:
    return (Path(path) / TRACKER).is_file()


def read_tracker(root: Path) -> int | str:
    text = (Path(root) / TRACKER).read_text().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError as err:
        raise UserError(f"{root / TRACKER} holds {text!r}, expected an iteration number or 'release'") from err


def latest_iteration_dir(root: Path) -> Path:
    """The directory of the latest complete iteration, or a UserError saying why there is none."""
    root = Path(root)
    if not is_megatron_checkpoint(root):
        raise UserError(f"{root} is not a Megatron checkpoint (no {TRACKER})")
    it_dir = root / iteration_dir_name(read_tracker(root))
    if not (it_dir / MARKER).is_file():
        raise UserError(f"{it_dir} is incomplete (no {MARKER} marker); the checkpoint cannot be trusted")
    return it_dir


def staging_dir(root: Path, iteration: int | str) -> Path:
    path = Path(root) / (iteration_dir_name(iteration) + ".staging")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def commit_iteration(root: Path, iteration: int | str, keep_last: int | None = None) -> Path:
    """Publish a fully written staging directory as iteration `iteration` and make it latest."""
    root = Path(root)
    staging = root / (iteration_dir_name(iteration) + ".staging")
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
    tmp = root / (TRACKER + ".tmp")
    tmp.write_text(f"{iteration}\n")
    os.replace(tmp, root / TRACKER)
    _fsync_dir(root)
    if keep_last is not None:
        prune(root, keep_last)
    return final


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
