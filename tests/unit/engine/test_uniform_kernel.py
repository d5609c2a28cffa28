"""The sampling draw's kernel (ouro_cli/kernels/uniform.py) on CPU, under the Triton
interpreter: its uniforms equal request_rng's torch code bit for bit (widths on and off its
block, keys on both sides of the sign bit, a greedy row's key 0) and the pure Python
reference; a row's uniforms are the same alone as in a batch; and keys it does not take
raise ValueError.

The checks live in _uniform_kernel_checks.py (shared with tests/gpu) and run in one
subprocess with TRITON_INTERPRET=1, which must be set before the kernel is imported."""

from __future__ import annotations

import pytest

from ._interpreted import interpreted_tests

pytest.importorskip("triton")

CHECKS = ["torch_bits", "rows_alone", "bad_input"]


report, test_uniform_kernel_under_the_interpreter = interpreted_tests("_uniform_kernel_checks.py", CHECKS)
