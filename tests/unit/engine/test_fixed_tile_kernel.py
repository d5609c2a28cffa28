"""Exact mode's fixed-tile linear kernel (ouro_cli/kernels/fixed_tile.py) on CPU, under the Triton
interpreter: it equals a dense fp64 x @ w.T to 1e-5 in fp32 and to 1 ulp in bf16 (M of 1 to 130
rows: one tile, a partial one, several; N and K on and off the tiles; a single output column); a
row's output is bitwise the same alone, in a batch of up to 130 rows and in reversed order;
every tile config of CONFIGS computes each element once, with the base config's bits; a fused
[q;k;v] weight gives each part's columns that part's bits; shapes or dtypes it does not take
raise ValueError. And exact mode's whole Triton path, what it runs on CUDA (these projections,
the decode kernel for the decode step, the prefill and the replay), gives the engine the
replay's logprobs to the bit, fp32 and bf16, on the tiny model with threshold exits (the engine
on fused weights, the replay on separate ones), in bf16 with prompts prefilled as on CUDA: in a
padded group at their bucket width, and alone at their own; and in bf16 with an fp8 KV cache,
whose packed rows the decode kernel reads. (The interpreter's dot is an fp32
product and sum: see gemv.py.) The checks live in _fixed_tile_checks.py (shared with
tests/gpu/test_exact_gpu.py) and run in one subprocess with TRITON_INTERPRET=1."""

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
    "configs",
    "fused_columns",
    "exact_engine_fp32",
    "exact_engine_grouped_bf16",
    "exact_engine_fp8_bf16",
]


report, test_fixed_tile_kernel_under_the_interpreter = interpreted_tests("_fixed_tile_checks.py", CHECKS)
