"""The engine's CUDA-graph pool holds one capture's transients, not one per capture
(engine/runner.py `capture`: every capture of a runner runs on one stream, and PyTorch caches
a pool's freed blocks per stream).

The engine keeps the graphs of up to KEPT_LAYOUTS cache layouts in one pool; a layout is new
whenever a released cache comes back with another size (`kv_cache.restore_blocks`). Here the
same prefill-heavy call runs on several layouts: each layout captures the same graphs again.
A kept graph keeps its outputs (logits of its rows) in the pool, a few MiB at this shape; its
transients (the activations of 32 prompts of 200 tokens, tens of MiB) are freed at the end of
the capture and serve the next one. With a stream per capture the pool grew by a capture's
transients every layout; now it grows by the outputs alone.
"""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams
from ouro_cli.model import build, tiny_config
from ouro_cli.rl.allocator import graph_pool_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MIB = 2**20


def test_the_graph_pool_does_not_grow_by_a_captures_transients_per_layout():
    config = tiny_config(hidden_size=512, intermediate_size=2048, vocab_size=4096)
    model = build(config, seed=0, device="cuda", dtype=torch.bfloat16)
    llm = LLM(model, max_num_seqs=32, kv_blocks=4096, block_size=16, cuda_graphs=True)
    index = torch.cuda.current_device()
    prompts = [[5 + (i * 7 + j) % 90 for j in range(200)] for i in range(32)]
    params = SamplingParams(max_tokens=2, seed=1, ignore_eos=True)
    try:
        assert llm.kv.fixed_address
        sizes, captures = [], []
        for blocks in (4096, 3000, 2000, 1500):  # four layouts, all kept (KEPT_LAYOUTS)
            llm.release_memory()
            llm.kv.restore(blocks=blocks)
            before = llm.runner.counters.graph_captures
            llm.generate(prompts, params)
            captures.append(llm.runner.counters.graph_captures - before)
            sizes.append(graph_pool_bytes(index))
        assert min(captures) >= 2, captures  # every layout captured its prefill and decode steps anew
        growth = [(b - a) / MIB for a, b in zip(sizes, sizes[1:], strict=False)]
        report = f"pool MiB {[round(s / MIB, 1) for s in sizes]}, captures {captures}"
        assert sizes[0] >= 16 * MIB, report  # the transients this test is about are there at all
        assert max(growth) <= 0.25 * sizes[0] / MIB, report
    finally:
        llm.close()
