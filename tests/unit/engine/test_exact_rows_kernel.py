"""Exact mode's row kernels (ouro_cli/kernels/exact_rows.py) on CPU, under the Triton interpreter:
RMSNorm (alone, closing a residual add, and followed by the next norm), silu·up and
log-softmax equal fp64 references written out independently, to a rounding or two of fp32 and
bf16; a row's bits are the same alone, in batches of 2 to 40 rows and reversed (and silu·up's
at any place in the tensor); their gradients are autograd's of the plain formulas, bit for bit.
RoPE's kernel equals the eager formula bit for bit (in bf16: written out with the
interpreter's truncating casts), on q and k that are views of a fused output too.
The whole exact Triton path, these kernels included, is checked end to end by
test_fixed_tile_kernel.py's exact_engine checks. The checks live in _exact_rows_checks.py
(shared with tests/gpu/test_exact_gpu.py) and run in one subprocess with TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest

from ._interpreted import interpreted_tests

pytest.importorskip("triton")

CHECKS = [
    "reference_fp32",
    "reference_bf16",
    "batch_invariance_fp32",
    "batch_invariance_bf16",
    "gradients_fp32",
    "gradients_bf16",
    "rotary_fp32",
    "rotary_bf16",
    "rotary_gqa_odd_heads",
]


report, test_exact_row_kernels_under_the_interpreter = interpreted_tests("_exact_rows_checks.py", CHECKS)
