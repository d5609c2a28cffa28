"""Every Triton kernel we own over drawn shapes (tests/unit/engine/_kernel_shape_checks.py),
under the Triton interpreter with a small budget of examples; tests/gpu runs a larger one."""

from __future__ import annotations

import pytest

from ._interpreted import interpreted_tests

pytest.importorskip("triton")
pytest.importorskip("hypothesis")

CHECKS = ["decode_attention", "replay_attention", "fixed_tile", "gemv", "row_kernels", "uniform", "fp8_rows"]

report, test_kernel_shapes_under_the_interpreter = interpreted_tests("_kernel_shape_checks.py", CHECKS)
