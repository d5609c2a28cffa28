"""The engine's CUDA-graph pool stays one capture's transients plus the graphs' outputs however
many steps it captures (engine/runner.py `capture`: one capture stream per runner). Captured on
a new stream each, the pool kept a copy of the transients per stream and grew with every
capture; the memory plan counts a fixed pool (rl/sizing.py `graph_pool_bytes`)."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams
from ouro_cli.model import build, tiny_config
from ouro_cli.rl.allocator import graph_pool_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_graph_pool_does_not_grow_with_the_number_of_captures():
    config = tiny_config(hidden_size=512, intermediate_size=1536, vocab_size=8192)
    model = build(config, seed=0, device="cuda", dtype=torch.bfloat16)
    llm = LLM(model, max_num_seqs=64, kv_blocks=2048, block_size=16, cuda_graphs=True)
    index = torch.cuda.current_device()
    params = SamplingParams(max_tokens=6, seed=1, ignore_eos=True)
    try:
        # batch buckets 8..64 and prefill widths 16..256: a dozen and more distinct captures
        sizes = []
        for rows, prompt in [(3, 12), (9, 40), (17, 90), (33, 200), (60, 250)]:
            llm.generate([[5 + i % 50] * prompt for i in range(rows)], params)
            sizes.append(graph_pool_bytes(index))
        captures = llm.runner.counters.graph_captures
        assert captures >= 10, captures
        # the first call's pool holds its transients; later captures reuse them, and add only
        # their outputs and their larger shapes' extra (widths and buckets grow 20-fold here)
        assert sizes[-1] <= 3 * max(sizes[0], 64 * 2**20), (sizes, captures)
    finally:
        llm.close()
