"""The one error path (ouro_cli.cli.common.run_command): any exception is one line and an
exit code, `--json` gets one document, OURO_DEBUG=1 adds the traceback."""

from __future__ import annotations

import errno
import json

import pytest
import typer

from ouro_cli.cli.common import describe_failure, rewrite_aliases, run_command
from ouro_cli.errors import CheckFailed, Interrupted, ResourceError, UserError


@pytest.mark.parametrize("err, code, line", [
    (UserError("bad --updates"), 2, "bad --updates"),
    (CheckFailed("runs differ"), 1, "runs differ"),
    (ResourceError("out of device memory in the train step"), 1, "out of device memory in the train step"),
    (Interrupted("stopped by SIGTERM", 15), 143, "stopped by SIGTERM"),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl"), 1,
     "/runs/x/metrics.jsonl: No space left on device: the disk is full; free space or write elsewhere, then "
     "run it again"),
    (PermissionError(errno.EACCES, "Permission denied", "/runs/x"), 1,
     "/runs/x: Permission denied: not allowed to write there; choose a writable directory"),
    (ZeroDivisionError("division by zero"), 1, "ZeroDivisionError: division by zero (OURO_DEBUG=1 shows the traceback)"),
    (RuntimeError("two\nlines"), 1, "RuntimeError: two lines (OURO_DEBUG=1 shows the traceback)"),
])
def test_every_failure_is_one_line_with_its_exit_code(err, code, line):
    assert describe_failure(err) == (line, code)


def _fails(capsys, monkeypatch, err, *, json_output=True, debug=False):
    if debug:
        monkeypatch.setenv("OURO_DEBUG", "1")
    else:
        monkeypatch.delenv("OURO_DEBUG", raising=False)

    def body():
        raise err

    with pytest.raises(typer.Exit) as exit_:
        run_command(body, json_output=json_output)
    out, err_text = capsys.readouterr()
    return exit_.value.exit_code, out, err_text


def test_json_gets_one_document_for_an_unexpected_error(capsys, monkeypatch):
    code, out, err = _fails(capsys, monkeypatch, KeyError("problem_id"))
    assert code == 1
    assert json.loads(out) == {"ok": False, "exit_code": 1,
                               "error": "KeyError: 'problem_id' (OURO_DEBUG=1 shows the traceback)"}
    assert err.count("\n") == 1 and "Traceback" not in err


def test_ouro_debug_shows_the_traceback_and_keeps_the_exit_code(capsys, monkeypatch):
    code, out, err = _fails(capsys, monkeypatch, UserError("bad [input]"), json_output=False, debug=True)
    assert code == 2 and out == ""
    assert "Traceback (most recent call last)" in err and err.rstrip().endswith("error: bad [input]")


def test_hidden_aliases_read_as_the_shown_names():
    aliases = {"--ouro-depths": "--depths"}
    assert rewrite_aliases(["train", "--ouro-depths", "2", "--ouro-depths=3", "--", "--ouro-depths"], aliases) == \
        ["train", "--depths", "2", "--depths=3", "--", "--ouro-depths"]
