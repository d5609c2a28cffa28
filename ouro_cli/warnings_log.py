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
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TextIO


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
        self._discard = False
        self._handler = _Records(self)

    def write(self, text: str) -> None:
        self.count += 1
        line = text.rstrip("\n") + "\n"
        if self._discard:
            return
        if self._file is None:
            self._pending.append(line)
        else:
            self._file.write(line)
            self._file.flush()

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        self.write(warnings.formatwarning(message, category, filename, lineno, line))

    def attach(self, path: Path) -> None:
        """Write the buffered warnings, and every later one, to `path` (appending)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a")  # noqa: SIM115 - closed in __exit__
        self.path = path
        self._file.writelines(self._pending)
        self._file.flush()
        self._pending = []

    def discard(self) -> None:
        """Keep no warnings from here on (a data-parallel rank other than 0: they repeat rank 0's)."""
        self._discard, self._pending = True, []

    def summary(self) -> str | None:
        if not self.count or self._discard:
            return None
        where = self.path if self.path is not None else "nowhere (the command stopped before it had a directory)"
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
