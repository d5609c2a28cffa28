"""The small-M linear kernel (ouro_cli/kernels/gemv.py) on CUDA (skipped without a GPU
or triton).

At the Ouro-1.4B shapes (qkv, o_proj, gate_up, down, lm_head) and M of 8, 16 and 64 in bf16,
with the default tiles: the kernel equals a dense fp64 x @ w.T rounded to bf16 to 1 ulp; a
row's output is bitwise the same alone (M = 1), among the first 8, 16 or 64 rows and in
reversed order (M = 64 runs two 32-row tiles, M <= 16 one 16-row tile: the same mma
instruction either way); and a CUDA graph replay gives the eager bits. The CPU checks of
tests/unit/engine/_gemv_kernel_checks.py run compiled too, fp32 (IEEE dots) and bf16.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine._gemv_kernel_checks import check_batch_invariance, check_reference, operands

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

SHAPES = {
    "qkv": (6144, 2048),
    "o_proj": (2048, 2048),
    "gate_up": (11264, 2048),
    "down": (2048, 5632),
    "lm_head": (49152, 2048),
}
ROWS = (8, 16, 64)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.mark.parametrize("name", SHAPES)
def test_1p4b_shapes_match_reference(name):
    check_reference("cuda", torch.bfloat16, shapes=[SHAPES[name]], rows=ROWS, configs=[{}])


@pytest.mark.parametrize("name", SHAPES)
def test_1p4b_shapes_are_batch_invariant(name):
    check_batch_invariance("cuda", torch.bfloat16, shapes=[SHAPES[name]], rows=ROWS, configs=[{}])


@DTYPES
def test_small_shapes_match_reference(dtype):
    check_reference("cuda", dtype)


@DTYPES
def test_small_shapes_are_batch_invariant(dtype):
    check_batch_invariance("cuda", dtype)


def test_graph_replay_equals_eager():
    from ouro_cli.kernels.gemv import small_m_linear

    n, k = SHAPES["gate_up"]
    for m in ROWS:
        x, w = operands(m, n, k, torch.bfloat16, "cuda")
        eager = small_m_linear(x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = small_m_linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"M={m}: graph replay differs from eager"
