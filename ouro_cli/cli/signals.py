"""SIGINT and SIGTERM from a command's first line: one line and exit 130 or 143, whatever runs.

Python's defaults print a KeyboardInterrupt traceback (SIGINT) or end the process without
a word (SIGTERM). `install`, the first thing `ouro` does, replaces both with a handler that
raises `Interrupted` (a BaseException, so no library's `except Exception` takes it), which
the one error path (common.py) turns into its line. The signal may come in the middle of
an import: torch is then left half-initialised, and importing it again crashes the
process. So neither this module nor the error path imports anything heavy.

While a run works (rl/stop.py `StopSignals`) the run's own handler decides when to stop;
it gives these handlers back when the run ends. Outside a command's body (its module
imports, the parsing of the command line) no error path is there yet: an `Interrupted`
that reaches the top is printed by `report_uncaught`, and the process ends at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from ouro_cli.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def install() -> None:
    """Stop with `Interrupted` on SIGINT and SIGTERM (main thread only, as Python requires)."""
    for sig in SIGNALS:
        signal.signal(sig, stop_at_once)
    sys.excepthook = report_uncaught


def stop_at_once(signum: int, frame) -> None:
    raise Interrupted(f"stopped by {signal.Signals(signum).name}", signum)


def report_uncaught(kind, err, tb) -> None:
    """An `Interrupted` nobody caught: its line (and `--json`'s document), then exit 128 + the
    signal without Python's shutdown, which may touch a module the signal left half-imported.
    Anything else goes to Python's own hook."""
    if not isinstance(err, Interrupted):
        sys.__excepthook__(kind, err, tb)
        return
    if "--json" in sys.argv:
        sys.stdout.write(
            json.dumps({"ok": False, "error": str(err), "exit_code": err.exit_code}, sort_keys=True) + "\n"
        )
    sys.stderr.write(f"error: {err}\n")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(err.exit_code)
