"""Every Triton kernel we own over drawn shapes on CUDA (tests/unit/engine/_kernel_shape_checks.py):
contexts up to 1,024 positions, up to 512 rows, 40 examples each. Each check runs in a process of
its own with the attention kernels' bounds checks on (OURO_CHECK_KERNELS=1) and synchronous
launches, so a bad index fails with its kernel named instead of a CUDA error that would poison
the checks after it; the failure shows hypothesis' falsifying example.
`compute-sanitizer --tool memcheck python tests/unit/engine/_kernel_shape_checks.py` runs the
same draws under the memory checker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")
pytest.importorskip("hypothesis")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "unit" / "engine" / "_kernel_shape_checks.py"
CHECKS = ["decode_attention", "replay_attention", "fixed_tile", "gemv", "row_kernels", "uniform", "fp8_rows"]


@pytest.mark.parametrize("name", CHECKS)
def test_kernel_over_drawn_shapes(name):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        OURO_CHECK_KERNELS="1",
        CUDA_LAUNCH_BLOCKING="1",
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), name], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and f"{name} ok" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-6000:]
