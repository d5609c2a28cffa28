"""The sampling draw on CUDA (skipped without a GPU or triton): the Triton kernel that
request_rng.uniform runs there (ouro_cli/kernels/uniform.py) gives the torch code's bits at
the decode step's shape (256 rows × the 49,152-entry vocabulary) and the small shapes of the
CPU checks, a row's bits alone as in a batch, and the same bits when replayed in a CUDA graph.
The engine counts the device time of its decode steps' forwards and sampling (step_timing.py)."""

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


def test_decode_steps_count_their_device_time():
    import time

    from ouro_cli.engine import LLM, SamplingParams
    from ouro_cli.model import build, tiny_config

    model = build(tiny_config(), seed=0, device="cuda", dtype=torch.bfloat16)
    llm = LLM(model, max_num_seqs=8, kv_blocks=64, block_size=16)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=0, ignore_eos=True)
    llm.generate([[5, 6, 7]] * 8, params)  # compile and capture
    before = llm.work_counters()
    start = time.perf_counter()
    llm.generate([[5, 6, 7]] * 8, params)
    wall_us = (time.perf_counter() - start) * 1e6
    after = llm.work_counters()
    llm.close()
    forward, sampling = (after[k] - before[k] for k in ("decode_forward_gpu_us", "decode_sample_gpu_us"))
    assert forward > 0 and sampling > 0 and forward + sampling <= wall_us, (forward, sampling, wall_us)
