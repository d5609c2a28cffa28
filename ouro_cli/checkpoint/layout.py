"""The Megatron checkpoint directory layout, and what makes an iteration valid.

    CKPT/
      latest_checkpointed_iteration.txt   "7" or "release"; rewritten atomically last
      iter_0000007/                       one megatron dist checkpoint per saved iteration
        readers.lock                      held (shared) by whoever reads the iteration
        ouro-plan.json                    a training run's plan as of this iteration (rl/plan.py)
        COMPLETE                          written after the dist checkpoint and extras
      release/                            the same, for converted (not trained) weights
      hf_assets/                          config.json, tokenizer files, remote code (*.py)

Invariant: an iteration is valid only when its directory has the `COMPLETE` marker. A
save writes `iter_N.staging/` first, marks it complete, renames it to `iter_N/`, and only
then points the tracker at it, so a process killed at any moment leaves the previous
latest iteration loadable. The latest iteration is the one the tracker names, or a newer
complete numbered one: a process killed between the rename and the tracker write (for
a first save: with no tracker at all) leaves a whole iteration the tracker does not name
yet, and it is the latest (`repair_tracker` then points the tracker at it). A tracker that
names an iteration which is gone or incomplete (removed by hand, as the error about a
damaged iteration suggests) falls back to the newest complete iteration before it. Older
iterations are pruned only after the tracker has moved.

Readers and the pruner: a reader (`pin_latest`: export, eval, convert, while `ouro train`
writes the run) holds the iteration's `readers.lock` shared for as long as it reads, and
`prune` removes an iteration only while holding that file exclusively, so `--keep-last`
never deletes an iteration under a reader: a pinned iteration waits for a later prune.
A reader that finds its iteration pruned between choosing it and pinning it chooses again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path

from ouro_cli.artifacts import MARKER, mark_complete
from ouro_cli.errors import UserError
from ouro_cli.testing import faults

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
HF_ASSETS = "hf_assets"
READERS = "readers.lock"
PLAN = "ouro-plan.json"  # a run's plan (rl/run_dir.py `RunDir.plan`), also in each iteration the run saves
PIN_ATTEMPTS = 20


def iteration_dir_name(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def is_megatron_checkpoint(path: Path) -> bool:
    """A complete numbered iteration, or a tracker whose iteration is there (a tracker left
    naming a removed iteration, with no complete one, is not a checkpoint: nothing to read)."""
    path = Path(path)
    if complete_iterations(path):
        return True
    if not (path / TRACKER).is_file():
        return False
    try:
        return (path / iteration_dir_name(read_tracker(path))).exists()
    except UserError:  # a damaged tracker: `latest_iteration` says what is wrong with it
        return True


def complete_iterations(root: Path) -> list[int]:
    """The numbered iterations under `root` that carry the COMPLETE marker, oldest first."""
    return sorted(
        int(p.name[len("iter_") :])
        for p in Path(root).glob("iter_???????")
        if p.name[len("iter_") :].isdigit() and (p / MARKER).is_file()
    )


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
    if (root / iteration_dir_name(tracked) / MARKER).is_file():
        return tracked
    if complete:  # the tracked iteration was removed or damaged: the newest complete one before it
        return complete[-1]
    raise UserError(
        f"{root / iteration_dir_name(tracked)} is incomplete (no {MARKER} marker); the checkpoint cannot be trusted"
    )


def latest_iteration_dir(root: Path) -> Path:
    """The directory of the latest complete iteration, or a UserError saying why there is none."""
    return Path(root) / iteration_dir_name(latest_iteration(root))


class ReaderPin:
    """A shared hold on an iteration's `readers.lock`: while it is held, `prune` leaves the
    iteration alone. Released by `release()`, or when the pin is garbage or the process ends."""

    def __init__(self, fd: int) -> None:
        self._close = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        self._close()


def pin_latest(root: Path) -> tuple[Path, ReaderPin | None]:
    """The latest complete iteration's directory, pinned against pruning for as long as the
    returned pin lives (module docstring). An iteration written before iterations carried
    `readers.lock` is returned unpinned; a UserError when there is none, or when the latest
    was pruned under this reader `PIN_ATTEMPTS` times in a row."""
    root = Path(root)
    for _ in range(PIN_ATTEMPTS):
        directory = latest_iteration_dir(root)
        try:
            fd = os.open(directory / READERS, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if (directory / MARKER).is_file():
                return directory, None
            continue  # pruned between choosing it and opening it: choose again
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits while the pruner removes it
        if _still_at(fd, directory / READERS) and (directory / MARKER).is_file():
            return directory, ReaderPin(fd)
        os.close(fd)  # removed, or replaced by a new save of the same iteration, while we waited
    raise UserError(f"{root}: the latest checkpoint was pruned {PIN_ATTEMPTS} times while opening it; run this again")


def _still_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the file at `path`."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _unread(iteration: Path, *, wait: bool) -> Iterator[bool]:
    """Hold `iteration`'s `readers.lock` exclusively for the block; yields whether no reader
    holds it (`wait`: wait until none does). An iteration without the file has no readers."""
    try:
        fd = os.open(iteration / READERS, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def repair_tracker(root: Path) -> int | str | None:
    """Point the tracker at the latest complete iteration when it names another (an interrupted
    save's last step, or an iteration removed since); returns that iteration when the tracker
    was rewritten, else None."""
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
    (staging / READERS).touch()
    mark_complete(staging)
    final = root / iteration_dir_name(iteration)
    if final.exists():  # re-saving the same iteration: move the old one aside first, once no one reads it
        old = root / (final.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        with _unread(final, wait=True):
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
    """Remove all but the newest `keep_last` numbered iterations (never the latest one, nor one
    a reader holds: a later prune removes it)."""
    latest = read_tracker(root)
    numbered = sorted(p for p in Path(root).glob("iter_???????") if p.is_dir())
    for path in numbered[: max(0, len(numbered) - keep_last)]:
        if path.name != iteration_dir_name(latest):
            with _unread(path, wait=False) as free:
                if free:
                    shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
