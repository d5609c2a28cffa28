"""The one error path (ouro_cli.cli.common.run_command): any exception is one line and an
exit code, `--json` gets one document, OURO_DEBUG=1 adds the traceback."""

from __future__ import annotations

import errno
import json

import pytest
import typer

from ouro_cli.cli.common import describe_failure, rewrite_aliases, run_command
from ouro_cli.errors import CheckFailed, Interrupted, ResourceError, UserError


@pytest.mark.parametrize(
    "err, code, line",
    [
        (UserError("bad --updates"), 2, "bad --updates"),
        (CheckFailed("runs differ"), 1, "runs differ"),
        (ResourceError("out of device memory in the train step"), 1, "out of device memory in the train step"),
        (Interrupted("stopped by SIGTERM", 15), 143, "stopped by SIGTERM"),
        (
            OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl"),
            1,
            "/runs/x/metrics.jsonl: No space left on device: the disk is full; free space or write elsewhere, then "
            "run it again",
        ),
        (
            PermissionError(errno.EACCES, "Permission denied", "/runs/x"),
            1,
            "/runs/x: Permission denied: not allowed to write there; choose a writable directory",
        ),
        (
            ZeroDivisionError("division by zero"),
            1,
            "ZeroDivisionError: division by zero (OURO_DEBUG=1 shows the traceback)",
        ),
        (RuntimeError("two\nlines"), 1, "RuntimeError: two lines (OURO_DEBUG=1 shows the traceback)"),
    ],
)
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
    assert json.loads(out) == {
        "ok": False,
        "exit_code": 1,
        "error": "KeyError: 'problem_id' (OURO_DEBUG=1 shows the traceback)",
    }
    assert err.count("\n") == 1 and "Traceback" not in err


def test_ouro_debug_shows_the_traceback_and_keeps_the_exit_code(capsys, monkeypatch):
    code, out, err = _fails(capsys, monkeypatch, UserError("bad [input]"), json_output=False, debug=True)
    assert code == 2 and out == ""
    assert "Traceback (most recent call last)" in err and err.rstrip().endswith("error: bad [input]")


def test_hidden_aliases_read_as_the_shown_names():
    aliases = {"--rollout-max-response-len": "--max-response-len"}
    assert rewrite_aliases(
        [
            "train",
            "--rollout-max-response-len",
            "2",
            "--rollout-max-response-len=3",
            "--",
            "--rollout-max-response-len",
        ],
        aliases,
    ) == ["train", "--max-response-len", "2", "--max-response-len=3", "--", "--rollout-max-response-len"]


def test_the_ouro_prefixed_spellings_are_unknown():
    import typer.main

    from ouro_cli.cli.app import app
    from ouro_cli.cli.common import HIDDEN_ALIASES

    assert "--rollout-max-response-len" in HIDDEN_ALIASES  # the registry is filled
    assert [a for a in HIDDEN_ALIASES if a.startswith("--ouro-")] == []
    train = typer.main.get_command(app).commands["train"]
    with pytest.raises(Exception, match="No such option: --ouro-depths") as caught:
        train.make_context("train", ["--ouro-depths", "2"])
    assert hasattr(caught.value, "format_message")  # click's usage error: exit 2, one line


def test_the_error_path_imports_nothing_heavy():
    """A signal may leave torch half-imported; the error path must not import it again (it
    crashed the process). A fresh interpreter reports every kind of failure without torch."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ouro_cli.cli.common import describe_failure\n"
        "from ouro_cli.errors import Interrupted, UserError\n"
        "for err in (Interrupted('stopped by SIGINT', 2), KeyboardInterrupt(), UserError('x'), ValueError('y'),\n"
        "            OSError(28, 'No space left on device')):\n"
        "    describe_failure(err)\n"
        "print(sorted(m for m in ('torch', 'numpy', 'ouro_cli.model') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_model_config_error_is_a_user_error_once_its_module_is_loaded():
    from ouro_cli.model.config import ConfigError

    assert describe_failure(ConfigError("hidden_size must be > 0")) == ("hidden_size must be > 0", 2)


def test_no_except_exception_takes_an_interrupt():
    with pytest.raises(Interrupted):
        try:
            raise Interrupted("stopped by SIGTERM", 15)
        except Exception:  # what a library or a plugin may write
            pass


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_before_any_command_is_one_line_and_its_exit_code(sig, code):
    """From the first line of `ouro` (cli/signals.py), even where no command's error path is
    there yet: the line, `--json`'s document, exit 128 + the signal."""
    import subprocess
    import sys

    code_text = (
        "import os, signal\n"
        "from ouro_cli.cli import signals\n"
        "signals.install()\n"
        f"os.kill(os.getpid(), signal.{sig})\n"
        "import time; time.sleep(30)\n"
    )
    done = subprocess.run([sys.executable, "-c", code_text, "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == code
    assert done.stderr == f"error: stopped by {sig}\n"
    assert json.loads(done.stdout) == {"ok": False, "error": f"stopped by {sig}", "exit_code": code}


def test_signals_raise_interrupted_within_a_command(capsys, monkeypatch):
    import os
    import signal
    import sys

    from ouro_cli.cli import signals

    monkeypatch.delenv("OURO_DEBUG", raising=False)
    previous = {sig: signal.getsignal(sig) for sig in signals.SIGNALS}
    hook = sys.excepthook
    try:
        signals.install()
        with pytest.raises(typer.Exit) as exit_:
            run_command(lambda: os.kill(os.getpid(), signal.SIGTERM), json_output=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.excepthook = hook
    out, err = capsys.readouterr()
    assert exit_.value.exit_code == 143
    assert json.loads(out) == {"ok": False, "error": "stopped by SIGTERM", "exit_code": 143}
    assert err == "error: stopped by SIGTERM\n"


def test_a_gpu_error_anywhere_is_one_line_naming_how_to_see_more():
    from ouro_cli.cli.common import describe_failure
    from ouro_cli.errors import is_device_fault

    class AcceleratorError(RuntimeError):  # torch's name for it, not imported here
        pass

    err = AcceleratorError("CUDA error: an illegal memory access was encountered\nSearch for `cudaErrorIllegalAddress'")
    message, code = describe_failure(err)
    assert code == 1 and "\n" not in message and message.startswith("CUDA error in the command: an illegal memory")
    assert "CUDA_LAUNCH_BLOCKING=1" in message and "ouro --debug" in message
    assert is_device_fault(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_device_fault(RuntimeError("shapes differ")) and not is_device_fault(ValueError("CUDA error"))
