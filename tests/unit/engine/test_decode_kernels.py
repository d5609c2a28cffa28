"""The Triton decode kernels on CPU, under the Triton interpreter: attention equals the torch
reference (paged_attention.decode_attention) and a dense fp64 one to 1e-5 in fp32 (MHA, GQA,
length 1, lengths off the tile grid, permuted slots); a row's output is bitwise the same
alone or among longer rows; the KV write fused into the attention kernel equals runner.py's
torch write exactly (and its output the unfused kernel's, bit for bit); and
an engine running them (and the small-batch matmul, kernels/gemv.py) reports the torch
path's logprobs and still equals the replay. The replay's attention through the decode
kernel (`replay_attention="paged"`) equals SDPA, gives each query the decode kernel's
bits for it alone, backpropagates SDPA's gradients, and keeps the engine's agreement; a
decode step whose width covers the rows' whole reach gives the narrow step's bits. Over an
fp8 cache's packed rows the kernel computes the bits it computes over the rows unpacked (an
engine on them: test_fixed_tile_kernel.py's exact_engine_fp8_bf16), and the same values packed as
twice the codes at half the scale give the same bits. The fp8 round trip's kernel
(kernels/fp8_rows.py) has the torch round trip's bits on rows of zeros, ties of the rounding,
fp32 subnormals and values that scale onto 448; the kernels' conversion of e4m3 codes gives
torch's values for every finite code; the fused write packs an fp8 cache's rows with
kv_quant.pack's bytes and carries an exited row's packed row forward byte for byte; the replay
on an fp8 cache gives each query the decode kernel's bits over the packed rows; and an engine
on an fp8 cache runs it and agrees with its replay.

The checks live in _decode_kernel_checks.py (shared with tests/gpu) and run in one
subprocess with TRITON_INTERPRET=1, which must be set before the kernels are imported
and would otherwise leak into every later test of this process."""

from __future__ import annotations

import pytest

from ._interpreted import interpreted_tests

pytest.importorskip("triton")

CHECKS = [
    "attention",
    "fp8_attention",
    "fp8_twice_the_codes",
    "fp8_round_trip",
    "e4m3_values",
    "batch_invariance",
    "write_and_attend",
    "write_and_attend_fp8",
    "write_and_attend_fp8_bf16",
    "engine",
    "engine_fp8",
    "replay_attention",
    "fp8_replay",
    "replay_mode_engine",
    "width_from_reach",
    "replay_tables_per_forward",
    "bounds_checks",
]


report, test_decode_kernels_under_the_interpreter = interpreted_tests("_decode_kernel_checks.py", CHECKS)
