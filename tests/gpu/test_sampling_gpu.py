"""The sampling draw on CUDA (skipped without a GPU or triton): the Triton kernel that
request_rng.uniform runs there (ouro_cli/kernels/uniform.py) gives the torch code's bits at
the decode step's shape (256 rows × the 49,152-entry vocabulary) and the small shapes of the
CPU checks, a row's bits alone as in a batch, and the same bits when replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine._uniform_kernel_checks import check_rows_alone, check_torch_bits, keys

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")


def test_torch_bits_at_small_and_decode_widths():
    check_torch_bits("cuda", widths=(1, 7, 1024, 1025, 3000, 49152))


def test_rows_alone():
    check_rows_alone("cuda")


def test_graph_replay_gives_the_eager_bits():
    from ouro_cli.engine.request_rng import torch_uniform
    from ouro_cli.kernels.uniform import uniform

    k = keys("cuda").repeat(43)[:256].contiguous()  # 256 rows, as a decode step at RL batch sizes
    eager = uniform(k, 49152)
    graph = torch.cuda.CUDAGraph()
    uniform(k, 49152)  # warm-up (compiles) outside capture
    with torch.cuda.graph(graph):
        captured = uniform(k, 49152)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager) and torch.equal(eager, torch_uniform(k, 49152))
