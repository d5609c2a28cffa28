"""Running kernel checks under the Triton CPU interpreter, shared by the kernel test files.

A check module (`_decode_kernel_checks.py`, `_gemv_kernel_checks.py`) is a script whose
`main` runs named checks through `run_checks`; the test file runs it in a subprocess
with TRITON_INTERPRET=1 (`interpreter_report`, through the fixture and test that
`interpreted_tests` makes), since the variable must be set before the kernels are imported
and would otherwise leak into every later test of the process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


def run_checks(checks: dict[str, Callable[[], None]], names: list[str]) -> int:
    """Run the named checks (all by default); one line `<name> ok|FAILED` each, then the
    failures' tracebacks. -> exit status."""
    import traceback

    if os.environ.get("TRITON_INTERPRET") == "1":
        keep_interpreter_bindings()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    failures = []
    for name in names or list(checks):
        try:
            checks[name]()
            print(name, "ok", flush=True)
        except Exception:
            print(name, "FAILED", flush=True)
            failures.append(traceback.format_exc())
    print(*failures, sep="\n")
    return 1 if failures else 0


def keep_interpreter_bindings() -> None:
    """Bind triton.language to the interpreter once for the whole process.

    Around every kernel launch the Triton interpreter rebinds each builtin of triton.language
    (and of its tensor class) to its interpreted version and restores them afterwards, so
    that code outside kernels sees the originals: most of a small launch's cost, and a check
    launches thousands. A check process runs no triton.language outside its kernels, so the
    builtins are bound once, before the first launch, and stay bound; each kernel runs as before.
    """
    import types

    import triton.language as tl
    from triton.runtime import interpreter

    bind = getattr(interpreter, "_patch_lang", None)
    if bind is None:  # another Triton: launches bind as they always do
        return
    language = types.FunctionType((lambda: None).__code__, {"tl": tl, "core": tl.core})  # globals name both
    bind(language)

    class Kept:
        def restore(self) -> None:
            pass

    interpreter._patch_lang = lambda fn: Kept()


def interpreter_report(script: Path, names: list[str]) -> tuple[dict[str, str], str]:
    """Run `script` with `names` under the interpreter -> ({name: "ok"|"FAILED"}, log tail)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script), *names], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    status = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ")[0] in names)
    return status, proc.stdout[-6000:] + proc.stderr[-6000:]


def interpreted_tests(script_name: str, checks: list[str]):
    """-> (a module-scoped fixture `report` that runs the check script `script_name`, beside this
    file, once under the interpreter; a test parametrized over `checks` that each one passed,
    marked slow). A test file binds both at module level: `report, test_x_under_the_interpreter = ...`."""
    script = Path(__file__).with_name(script_name)

    @pytest.fixture(scope="module")
    def report() -> tuple[dict[str, str], str]:
        return interpreter_report(script, checks)

    @pytest.mark.slow
    @pytest.mark.parametrize("check", checks)
    def test(report, check):
        status, log = report
        assert status.get(check) == "ok", log

    return report, test
