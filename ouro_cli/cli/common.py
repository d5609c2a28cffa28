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

from ouro_cli.errors import CheckFailed, ResourceError, UserError

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
    except ResourceError as err:
        _fail(str(err), ResourceError.exit_code, json_output)
    except _user_error_types() as err:
        _fail(str(err), UserError.exit_code, json_output)
    except KeyboardInterrupt:
        _fail("interrupted", 130, json_output)
    else:
        if json_output and result is not None and _is_main_rank():
            emit_json({"ok": True, **result})


def _is_main_rank() -> bool:
    """Under torchrun only rank 0 prints the result document."""
    import os

    return int(os.environ.get("RANK", "0")) == 0


def _fail(message: str, code: int, json_output: bool, result: dict[str, Any] | None = None) -> None:
    if json_output:
        emit_json({"ok": False, "error": message, "exit_code": code, **(result or {})})
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    raise typer.Exit(code)


JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document with the result on stdout.")
OVERWRITE_OPTION = typer.Option(False, "--overwrite", help="Replace a non-empty output directory.")


MULTI_VALUE_OPTIONS = ("--depths", "--eval-depths", "--prefill-devices", "--decode-devices")


def expand_multi_value_options(argv: list[str], names: tuple[str, ...] = MULTI_VALUE_OPTIONS) -> list[str]:
    """Let list options take several values after one flag, as in `--depths 2 3 4`.

    Click options take one value per occurrence; this rewrites `--depths 2 3 4` into
    `--depths 2 --depths 3 --depths 4`. Only integers are consumed, so a positional
    argument after the list (`--depths 2 3 RUN`) stays positional.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        out.append(arg)
        i += 1
        if arg in names:
            first = True
            while i < len(argv) and _is_int(argv[i]):
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
