"""Third-party warnings go to a file, not the console.

Importing and running megatron-core, torch.distributed.checkpoint and inductor emits
dozens of warnings per command (deprecations, optional dependencies that are absent,
config notices) that say nothing about the user's run. While a `WarningsLog` is
installed, every warning shown through `warnings` and every log record of WARNING or
above from a logger outside `ouro_cli` is written to a file instead (buffered until
`attach` names it, so warnings raised before the run directory is known are kept); the
command then prints one line saying how many there were and where they are.

    with WarningsLog() as log:
        ...                         # imports, setup
        log.attach(run / "logs" / "warnings.log")
        ...
    console.print(log.summary())

Commands wrap their body in `quiet`, which also keeps compiled kernels in the user's
cache directory; code deeper down names the file once it knows it with `attach_active`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ouro_cli import env


class _Records(logging.Handler):
    def __init__(self, sink: WarningsLog) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith("ouro_cli"):
            self.sink.write(f"{record.levelname} {record.name}: {record.getMessage()}")


class WarningsLog:
    def __init__(self) -> None:
        self.count = 0
        self.path: Path | None = None
        self._pending: list[str] = []
        self._file: TextIO | None = None
        self._target: Path | None = None
        self._discard = False
        self._handler = _Records(self)

    def write(self, text: str) -> None:
        self.count += 1
        line = text.rstrip("\n") + "\n"
        if self._discard:
            return
        self._pending.append(line)
        self._flush()

    def _flush(self) -> None:
        """Write what is pending once the command's directory is in use (`ready`), so that a
        command refused early creates nothing."""
        if self._file is None and self._target is not None and self._ready():
            self._target.parent.mkdir(exist_ok=True)
            self._file = open(self._target, "a")  # noqa: SIM115 - closed in __exit__
        if self._file is not None and self._pending:
            self._file.writelines(self._pending)
            self._file.flush()
            self._pending = []

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        self.write(warnings.formatwarning(message, category, filename, lineno, line))

    def attach(self, path: Path, shown: Path | None = None, ready: Callable[[], bool] | None = None) -> None:
        """Write the buffered warnings, and every later one, to `path` (appending) once `ready()`
        (default: once the directory above the file's exists); the summary names `shown` (where
        the file ends up, for a staged output) or `path`."""
        self._target, self.path = Path(path), shown or Path(path)
        self._ready = ready or self._target.parent.parent.is_dir
        self._flush()

    def discard(self) -> None:
        """Keep no warnings from here on (a data-parallel rank other than 0: they repeat rank 0's)."""
        self._discard, self._pending = True, []

    def summary(self) -> str | None:
        if not self.count or self._discard:
            return None
        self._flush()
        where = self.path if self._file is not None else "nowhere (the command stopped before it had a directory)"
        return f"{self.count} third-party warning{'s' if self.count != 1 else ''} in {where}"

    def __enter__(self) -> WarningsLog:
        self._saved = warnings.showwarning
        warnings.showwarning = self._show
        root = logging.getLogger()
        self._root_level = root.level
        if root.level > logging.WARNING or root.level == logging.NOTSET:
            root.setLevel(logging.WARNING)
        root.addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        warnings.showwarning = self._saved
        root = logging.getLogger()
        root.removeHandler(self._handler)
        root.setLevel(self._root_level)
        if self._file is not None:
            self._file.close()
            self._file = None


_ACTIVE: list[WarningsLog] = []


def attach_active(
    path: Path, shown: Path | None = None, *, ready: Callable[[], bool] | None = None, keep: bool = True
) -> None:
    """Name the file of the command's WarningsLog (see `quiet`, `WarningsLog.attach`); `keep=False`
    drops them instead (a data-parallel rank other than 0, whose warnings repeat rank 0's)."""
    if not _ACTIVE:
        return
    if keep:
        _ACTIVE[-1].attach(path, shown, ready)
    else:
        _ACTIVE[-1].discard()


def quiet(body: Callable[[], Any], say: Callable[[str], None]) -> Callable[[], Any]:
    """`body` with third-party warnings sent to a file (`attach_active`; `say` prints the one
    closing line) and compiled kernels cached in the user's cache directory
    ($XDG_CACHE_HOME/ouro, else ~/.cache/ouro)."""

    def run() -> Any:
        cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ouro"
        env.set_default("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
        env.set_default("TRITON_CACHE_DIR", str(cache / "triton"))
        with WarningsLog() as log:
            _ACTIVE.append(log)
            try:
                return body()
            finally:
                _ACTIVE.pop()
                if log.summary():
                    say(log.summary())

    return run
