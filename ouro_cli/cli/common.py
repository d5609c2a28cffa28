"""What every command shares: the consoles, JSON output, and the one error path.

As git, pip and vLLM do: a report that is the command's product (`ouro status`, `ouro data
check`, a run's summary table) goes to stdout (`report_console`), so `> file` and `| grep`
capture it; logs, progress and errors go to stderr (`console`). `--json` prints one JSON
document on stdout, in every case (an error included: `{"ok": false, "error": ..., "exit_code":
...}`), and the report then goes to stderr. Off a terminal, lines are never wrapped (a log
keeps one line per message); tables still fit the console's width.

Every exception that reaches a command becomes one line saying what went wrong and what
to do (`describe_failure`), never a traceback. Exit codes: 0 success; 1 a check failed
or the command failed at run time (CheckFailed, ResourceError, an OS error, a bug);
2 bad usage or input (UserError, a model ConfigError); 128 + the signal for a command
stopped by SIGINT (130) or SIGTERM (143), at any moment (signals.py). `OURO_DEBUG=1` (or
`ouro --debug …`) prints the traceback as well, exit codes unchanged.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from ouro_cli import env
from ouro_cli.errors import (
    CheckFailed,
    Interrupted,
    ResourceError,
    UserError,
    device_fault_line,
    is_device_fault,
)
from ouro_cli.testing import faults


class _Console(Console):
    """A Rich console that never wraps a line it prints to anything but a terminal."""

    def print(self, *objects: Any, soft_wrap: bool | None = None, **options: Any) -> None:
        super().print(*objects, soft_wrap=not self.is_terminal if soft_wrap is None else soft_wrap, **options)


console = _Console(stderr=True, highlight=False)
_stdout = _Console(highlight=False)
DEBUG_ENV = "OURO_DEBUG"


def _user_error_types() -> tuple[type[BaseException], ...]:
    """UserError, and the model's ConfigError once its module is loaded (no error can be one
    before). Nothing is imported here: a signal may have left torch half-imported, and the
    model package imports it (signals.py)."""
    config = sys.modules.get("ouro_cli.model.config")
    return (UserError, config.ConfigError) if config is not None else (UserError,)


def report_console(json_output: bool) -> Console:
    """Where a command prints its human report: stdout, or stderr when stdout carries `--json`'s
    document. Quiet wherever the log console is (the ranks other than 0 of a torchrun job)."""
    if json_output:
        return console
    _stdout.quiet = console.quiet
    return _stdout


def emit_json(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def run_command(body: Callable[[], dict[str, Any] | None], *, json_output: bool = False) -> None:
    """Run a command body; every failure becomes one line and an exit code (`describe_failure`).

    `body` returns the result document printed by `--json` (None prints nothing).
    """
    try:
        faults.point("command")
        result = body()
    except (typer.Exit, SystemExit):
        raise
    except BaseException as err:  # the one place every failure is reported
        if debugging():
            traceback.print_exc(file=sys.stderr)
        message, code = describe_failure(err)
        try:
            _fail(message, code, json_output, result=getattr(err, "result", None))
        finally:
            if is_device_fault(err):
                _exit_at_once(code)
    else:
        if json_output and result is not None and is_main_rank():
            emit_json({"ok": True, **result})


def _exit_at_once(code: int) -> None:
    """End the process now, without the interpreter's teardown: after a GPU error the CUDA
    context is lost, and the destructors' CUDA calls would abort the process natively. The
    helper processes it started (megatron-core's checkpoint writer, spawned, so they do not
    die with it) are stopped first; they would hold its output open."""
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is not None:
        for child in multiprocessing.active_children():
            child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def debugging() -> bool:
    return env.debug()


_DEBUG_HINT = f"{DEBUG_ENV}=1 shows the traceback"


def describe_failure(err: BaseException) -> tuple[str, int]:
    """(one line, exit code) for any exception: known failures say what to do themselves."""
    if isinstance(err, CheckFailed | ResourceError | Interrupted):
        return str(err), err.exit_code
    if isinstance(err, _user_error_types()):
        return str(err), UserError.exit_code
    if is_device_fault(err):
        return device_fault_line("the command", err), 1
    if isinstance(err, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(err, MemoryError):
        return f"out of host memory ({err or 'MemoryError'}); use a machine with more memory or smaller sizes", 1
    if isinstance(err, OSError):
        where = f"{err.filename}: " if err.filename else ""
        what = err.strerror or str(err)
        if err.errno == errno.ENOSPC:
            return f"{where}{what}: the disk is full; free space or write elsewhere, then run it again", 1
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"{where}{what}: not allowed to write there; choose a writable directory", 1
        return f"{where}{what} ({type(err).__name__}); {_DEBUG_HINT}", 1
    text = " ".join(str(err).split()) or "(no message)"
    return f"{type(err).__name__}: {text} ({_DEBUG_HINT})", 1


def is_main_rank() -> bool:
    """Under torchrun only rank 0 prints the result document."""
    return env.rank() == 0


def _fail(message: str, code: int, json_output: bool, result: dict[str, Any] | None = None) -> None:
    if json_output:
        emit_json({"ok": False, "error": message, "exit_code": code, **(result or {})})
    console.print(f"[bold red]error:[/] {rich_escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def rich_escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document with the result on stdout. \\[default: off]")
OVERWRITE_OPTION = typer.Option(
    False, "--overwrite", help="Replace a non-empty output directory (never an input). \\[default: off]"
)


def run_app(app: typer.Typer, args: list[str], *, json_output: bool) -> int:
    """Run the application; returns the exit code. With `--json`, a usage error (an unknown
    flag, a value of the wrong type) is a JSON document on stdout too."""
    if not json_output:
        app(args=args, prog_name="ouro")  # exits by itself
        return 0
    try:
        code = app(args=args, prog_name="ouro", standalone_mode=False)
    except Exception as err:
        # click's ClickException (typer vendors click under its own name in newer releases)
        if not (hasattr(err, "format_message") and isinstance(getattr(err, "exit_code", None), int)):
            raise
        emit_json({"ok": False, "error": err.format_message(), "exit_code": err.exit_code})
        from typer import rich_utils

        rich_utils.rich_format_error(err)
        return err.exit_code
    return code if isinstance(code, int) else 0


HIDDEN_ALIASES: dict[str, str] = {}  # alias -> option name: accepted, not shown (see hidden_alias)


def hidden_alias(alias: str, name: str) -> None:
    """Accept `alias` for the option `name` without listing it in the help: other tools'
    spellings (`--use-distributed-optimizer`) stay valid, and the help's option column fits 80
    columns."""
    if HIDDEN_ALIASES.setdefault(alias, name) != name:
        raise ValueError(f"{alias} already stands for {HIDDEN_ALIASES[alias]}")


def rewrite_aliases(argv: list[str], aliases: dict[str, str] = HIDDEN_ALIASES) -> list[str]:
    """`--rollout-max-response-len 8` and `--rollout-max-response-len=8` read as
    `--max-response-len 8` (nothing after `--`)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        name, eq, value = arg.partition("=")
        out.append(aliases[name] + eq + value if name in aliases else arg)
    return out


MULTI_VALUE_OPTIONS = ("--depths", "--eval-depths", "--prefill-devices", "--decode-devices")
FLOAT_MULTI_VALUE_OPTIONS = ("--is-bounds",)  # these take numbers (`--is-bounds 0.5 2`)


def expand_multi_value_options(argv: list[str], names: tuple[str, ...] = MULTI_VALUE_OPTIONS) -> list[str]:
    """Let list options take several values after one flag, as in `--depths 2 3 4`.

    Click options take one value per occurrence; this rewrites `--depths 2 3 4` into
    `--depths 2 --depths 3 --depths 4`. Only integers are consumed, so a positional
    argument after the list (`--depths 2 3 RUN`) stays positional; the options of
    FLOAT_MULTI_VALUE_OPTIONS consume numbers.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        out.append(arg)
        i += 1
        if arg in names or arg in FLOAT_MULTI_VALUE_OPTIONS:
            takes = _is_int if arg in names else _is_number
            first = True
            while i < len(argv) and takes(argv[i]):
                if not first:
                    out.append(arg)
                out.append(argv[i])
                first = False
                i += 1
    return out


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
