"""The small-M linear kernel (ouro_cli/kernels/gemv.py) on CPU, under the Triton
interpreter: it equals a dense fp64 x @ w.T to 1e-5 in fp32 and to 1 ulp in bf16 (M of 1,
3, 8, 16 and 40, the last in two row tiles; N and K on and off the tiles; default and small
tiles); a row's output is bitwise the same alone, among the first rows of a batch of up to
64 and in reversed order; shapes or dtypes it does not take raise ValueError; and
`--decode-gemv auto` routes each product by its shape. (In the interpreter the kernel's
dot is an fp32 product and sum, not the interpreter's tl.dot, numpy's matmul, whose BLAS
may sum a row by its place in the tile and which mishandles bf16: see gemv.py.)

The checks live in _gemv_kernel_checks.py (shared with tests/gpu) and run in one
subprocess with TRITON_INTERPRET=1, which must be set before the kernel is imported and
would otherwise leak into every later test of this process."""

from __future__ import annotations

import pytest

from ._interpreted import interpreted_tests

pytest.importorskip("triton")

CHECKS = [
    "reference_fp32",
    "reference_bf16",
    "batch_invariance_fp32",
    "batch_invariance_bf16",
    "bad_input",
    "auto_routing",
]


report, test_gemv_kernel_under_the_interpreter = interpreted_tests("_gemv_kernel_checks.py", CHECKS)
