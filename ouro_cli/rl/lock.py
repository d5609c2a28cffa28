"""The run lock: one process at a time trains, resumes or verifies a directory.

`DIR/ouro.lock` exists while `ouro train`, `ouro resume` or `ouro verify-resume` works in
DIR: it carries that process's exclusive `fcntl.flock` and names it as one JSON object
(pid, host, command, since). A second process is refused with one line naming the
holder (`RunLocked`, exit 2) instead of interleaving its writes with the first's.

The kernel drops a flock when the process that took it dies, however it dies, so a lock
file left behind by a killed process is free: the next process takes it over and says
whose it was. A clean release removes the file while still holding the flock (and the
directory too, when the lock created it and nothing else was written there: a command
refused at once leaves nothing behind); a process that was waiting on the removed file
sees that the path no longer names its file and locks the one there now, so two
processes never hold "the" lock at once. Under torchrun only rank 0 takes the lock; the
other ranks are the same job. `read_lock` tells who holds a directory without taking it
(for `ouro status`).

The same lock guards an artifact while it is written (`output_lock`, ouro_cli/outputs.py):
its file is then a hidden sibling of the output (`.OUT.lock`), since the output itself is
replaced whole when it is published.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ouro_cli import env
from ouro_cli.errors import UserError

LOCK_FILE = "ouro.lock"


class RunLocked(UserError):
    """Another live process holds the directory's lock."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    command: str
    since: float

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host} ({self.command}, since {started})"


def _parse(text: str) -> Holder | None:
    try:
        data = json.loads(text)
        return Holder(
            pid=int(data["pid"]), host=str(data["host"]), command=str(data["command"]), since=float(data["since"])
        )
    except (ValueError, KeyError, TypeError):
        return None


def _read(fd: int) -> Holder | None:
    os.lseek(fd, 0, os.SEEK_SET)
    return _parse(os.read(fd, 4096).decode(errors="replace"))


def _dead(holder: Holder) -> bool:
    """Whether `holder` is a process of this host that no longer exists."""
    if holder.host != socket.gethostname():
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def read_lock(directory: Path) -> Holder | None:
    """The live holder of `directory`'s lock, or None when it is free (no lock file, or one
    whose process has ended)."""
    path = Path(directory) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd) or Holder(pid=-1, host="?", command="?", since=0.0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class RunLock:
    """`with RunLock(run_dir, "ouro train"):` holds `run_dir`'s lock for the block (creating
    the directory when `create`); a live holder elsewhere is a `RunLocked` error. `path` puts
    the lock file elsewhere than `run_dir/ouro.lock` (`output_lock`); the directory it lies in
    is the one created, and `directory` is what the refusal names."""

    def __init__(
        self,
        directory: Path,
        command: str,
        *,
        create: bool = True,
        log: Callable[[str], None] = lambda s: None,
        path: Path | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.command = command
        self.create = create
        self.log = log
        self.path = Path(path) if path is not None else self.directory / LOCK_FILE
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> None:
        home = self.path.parent
        if not home.is_dir():
            if not self.create:
                raise UserError(f"{home} does not exist")
            home.mkdir(parents=True, exist_ok=True)
            self._created = True
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as err:
                raise UserError(
                    f"cannot create the lock file {self.path} ({err.strerror}); the directory must be writable"
                ) from None
            try:
                self._take(fd)
            except BaseException:
                os.close(fd)
                raise
            if self._still_at_path(fd):
                break
            os.close(fd)  # its holder removed it while we waited: lock the file that is there now
        self._fd = fd

    def _still_at_path(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _take(self, fd: int) -> None:
        # Look again when the lock seems held by nobody alive: a holder that has just taken it
        # and not yet written its record, or a `read_lock` looking at a dead holder's file.
        for attempt in range(20):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _read(fd)
                if (holder is not None and not _dead(holder)) or attempt == 19:
                    shown = holder.describe() if holder else "another process"
                    raise RunLocked(
                        f"{self.directory} is in use by {shown}; wait for it to finish or stop it, then run this again"
                    ) from None
                time.sleep(0.05)
        stale = _read(fd)
        if stale is not None:
            self.log(f"{self.path}: took over the lock left by {stale.describe()}, which is no longer running")
        me = Holder(pid=os.getpid(), host=socket.gethostname(), command=self.command, since=time.time())
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(asdict(me), sort_keys=True) + "\n").encode(), 0)
        os.fsync(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            self.path.unlink()  # under the flock: see the module docstring
            if self._created:
                self.path.parent.rmdir()  # only when empty
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> RunLock:
        if env.rank() == 0:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def output_lock(out: Path, command: str) -> RunLock:
    """The lock of an output that is written and then published whole: `.NAME.lock` beside
    it, so that two writers of one output never both publish (module docstring)."""
    out = Path(out)
    return RunLock(out, command, path=out.parent / f".{out.name}.lock")
