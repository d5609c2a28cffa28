"""What every command shares: the stderr console, JSON output, and user-error handling.

Human output and progress go to stderr; `--json` prints one JSON document on stdout, in
every case (an error included). Exit codes: 0 success, 1 a check failed, 2 bad usage or
input. A user error is one line, never a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from ouro_cli.errors import CheckFailed, UserError

console = Console(stderr=True, highlight=False)


def _user_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [UserError]
    try:  # the model's config errors are user errors when they reach the CLI
        from ouro_cli.model.config import ConfigError

        types.append(ConfigError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def emit_json(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def run_command(body: Callable[[], dict[str, Any] | None], *, json_output: bool = False) -> None:
    """Run a command body; map known failures to one line and an exit code.

    `body` returns the result document printed by `--json` (None prints nothing).
    """
    try:
        result = body()
    except CheckFailed as err:
        _fail(str(err), CheckFailed.exit_code, json_output, result=getattr(err, "result", None))
    except _user_error_types() as err:
        _fail(str(err), UserError.exit_code, json_output)
    except KeyboardInterrupt:
        _fail("interrupted", 130, json_output)
    else:
        if json_output and result is not None:
            emit_json({"ok": True, **result})


def _fail(message: str, code: int, json_output: bool, result: dict[str, Any] | None = None) -> None:
    if json_output:
        emit_json({"ok": False, "error": message, "exit_code": code, **(result or {})})
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    raise typer.Exit(code)


JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document with the result on stdout.")
OVERWRITE_OPTION = typer.Option(False, "--overwrite", help="Replace a non-empty output directory.")
