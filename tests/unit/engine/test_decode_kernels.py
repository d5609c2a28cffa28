"""The Triton decode kernels on CPU, under the Triton interpreter: attention equals the torch
reference (paged_attention.decode_attention) and a dense fp64 one to 1e-5 in fp32 (MHA, GQA,
length 1, lengths off the tile grid, permuted slots); a row's output is bitwise the same
alone or among longer rows; the fused KV write equals runner.py's torch write exactly; and
an engine running them (and the small-batch matmul, kernels/gemv.py) reports the torch
path's logprobs and still equals the replay.

The checks live in _decode_kernel_checks.py (shared with tests/gpu) and run in one
subprocess with TRITON_INTERPRET=1, which must be set before the kernels are imported
and would otherwise leak into every later test of this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[3]
CHECKS = ["attention", "batch_invariance", "write_kv_with_carry", "engine"]


@pytest.fixture(scope="module")
def report() -> tuple[dict[str, str], str]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("OURO_DECODE_ATTENTION", None)
    env.pop("OURO_DECODE_GEMV", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_decode_kernel_checks.py")), *CHECKS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    status = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ")[0] in CHECKS)
    return status, proc.stdout[-6000:] + proc.stderr[-6000:]


@pytest.mark.parametrize("check", CHECKS)
def test_decode_kernels_under_the_interpreter(report, check):
    status, log = report
    assert status.get(check) == "ok", log
