"""The sampling draw's kernel (ouro_cli/kernels/uniform.py) on CPU, under the Triton
interpreter: its uniforms equal request_rng's torch code bit for bit (widths on and off its
block, keys on both sides of the sign bit, a greedy row's key 0) and the pure Python
reference; a row's uniforms are the same alone as in a batch; and keys it does not take
raise ValueError.

The checks live in _uniform_kernel_checks.py (shared with tests/gpu) and run in one
subprocess with TRITON_INTERPRET=1, which must be set before the kernel is imported."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._interpreted import interpreter_report

pytest.importorskip("triton")

CHECKS = ["torch_bits", "rows_alone", "bad_input"]


@pytest.fixture(scope="module")
def report() -> tuple[dict[str, str], str]:
    return interpreter_report(Path(__file__).with_name("_uniform_kernel_checks.py"), CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_uniform_kernel_under_the_interpreter(report, check):
    status, log = report
    assert status.get(check) == "ok", log
