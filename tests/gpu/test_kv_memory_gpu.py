"""The KV cache at a fixed address on CUDA (engine/kv_memory.py; skipped without a GPU or cuda-bindings).

The reserved buffer maps memory under the same address on every take, zeroed, and gives
the device its memory back on release. An engine whose cache is released between calls
(as a colocated trainer makes it) replays the CUDA graphs it captured before: a call of a
shape it ran before captures nothing, and every call gives the outputs of an engine that
never released its cache, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams
from ouro_cli.engine.kv_memory import ReservedBuffer, device_buffer
from tests.unit.engine.conftest import prompts, tiny_model

pytestmark = pytest.mark.gpu
pytest.importorskip("cuda.bindings")

MIB = 2**20


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_reserved_buffer_comes_back_at_its_address_zeroed_and_frees_its_memory():
    device = torch.device("cuda")
    buffer = device_buffer(256 * MIB, torch.bfloat16, device)
    assert isinstance(buffer, ReservedBuffer)
    try:
        a = buffer.take(100 * MIB)
        address = a.data_ptr()
        assert a.dtype == torch.bfloat16 and a.numel() == 100 * MIB and not a.any()
        a.fill_(3.0)
        torch.cuda.synchronize()
        free_held = torch.cuda.mem_get_info()[0]
        del a
        buffer.give_back()
        assert torch.cuda.mem_get_info()[0] - free_held >= 200 * MIB - 2 * MIB  # 100 Mi bf16 elements
        b = buffer.take(256 * MIB)  # larger this time: the same base
        assert b.data_ptr() == address and not b.any()
        b[-1] = 1.0
        assert float(b[-1]) == 1.0
        del b
        with pytest.raises(RuntimeError, match="give it back first"):
            buffer.take(1)
        buffer.give_back()
        with pytest.raises(ValueError, match="reserves"):
            buffer.take(256 * MIB + 1)
    finally:
        buffer.close()


def test_a_dropped_buffer_gives_its_memory_back():
    import gc

    buffer = device_buffer(256 * MIB, torch.bfloat16, torch.device("cuda"))
    taken = buffer.take(200 * MIB)
    torch.cuda.synchronize()
    free_held = torch.cuda.mem_get_info()[0]
    del taken, buffer
    gc.collect()
    assert torch.cuda.mem_get_info()[0] - free_held >= 400 * MIB - 2 * MIB


def _rollout(llm: LLM, k: int, n: int, seed: int):
    params = [
        SamplingParams(max_tokens=24, seed=seed + i, logprobs=0, max_loops=k, exit_threshold=0.6, ignore_eos=True)
        for i in range(n)
    ]
    outs = llm.generate(prompts(n, seed=1), params)  # one shape: new samples of the same prompts
    return [(o.output_token_ids, o.exit_depths, o.log_probs) for o in outs]


def test_released_engine_replays_its_graphs_and_gives_the_same_outputs():
    model = tiny_model(0).cuda()
    kept = LLM(model, max_num_seqs=8, kv_blocks=200, block_size=4, cuda_graphs=True)
    released = LLM(model, max_num_seqs=8, kv_blocks=200, block_size=4, cuda_graphs=True)
    try:
        assert released.kv.fixed_address
        captures = []
        # K cycles as a run's depth schedule does
        for step, k in enumerate([2, 4, 2, 4, 3, 2]):
            released.release_memory()
            got = _rollout(released, k, 6, seed=10 * step)
            assert got == _rollout(kept, k, 6, seed=10 * step), (step, k)
            captures.append(released.work_counters()["graph_captures"])
        # the second K = 2 and K = 4 calls, and the last K = 2, replay what the first captured
        assert captures[2] == captures[1] and captures[3] == captures[2] and captures[5] == captures[4], captures
        assert captures[4] > captures[3]  # K = 3: a view of its own
    finally:
        kept.close()
        released.close()
