"""The KV cache holds as many planes per token as the call's budget K needs.

A `generate` whose requests decode at most K loops re-views the same buffer with K
planes, so K = 2 fits twice the tokens of the T-plane view; the engine still equals the
trainer's replay (fp32, 1e-5) for fixed budgets and threshold exits, also when the
smaller view forces preemption and recomputation. Releasing the cache's memory and
taking it back changes no output. An fp8 cache stores packed rows (head_dim fp8 bytes and a
scale byte per token and head: model/kv_quant.py) in the same layout, which every copy of
slots moves whole, and an engine on it (exact mode: docs/exact.md) still equals its replay
through preemption and recomputation.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams
from ouro_cli.engine.kv_cache import PagedKVCache, capacity_blocks, restore_blocks
from ouro_cli.model import kv_quant
from ouro_cli.settings import ExecutionSettings

from .conftest import prompts, tiny_model
from .test_replay import TOL, max_replay_error

T = 4


def cache(num_blocks: int = 10, fp8: bool = False) -> PagedKVCache:
    return PagedKVCache(
        fp8=fp8,
        num_layers=2,
        num_loops=T,
        num_blocks=num_blocks,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
    )


def test_views_share_one_buffer_and_scale_with_planes():
    kv = cache(num_blocks=10)
    full = kv.nbytes
    # 11 blocks (incl. scratch) of T planes hold 44 plane-blocks: 22 at two planes, 44 at one
    assert [kv.blocks_at(p) for p in (4, 2, 1)] == [10, 21, 43]
    base = kv.k.data_ptr()
    for planes in (2, 1, 3, 4):
        kv.set_planes(planes)
        assert kv.k.shape[1] == planes and kv.num_blocks == kv.blocks_at(planes)
        assert kv.k.data_ptr() == base and kv.nbytes == full
        assert kv.scratch_slot == kv.num_blocks * kv.block_size
        assert kv.bytes_per_token() == 2 * 2 * planes * 2 * 8 * 4
        assert kv.allocator.num_free == kv.num_blocks


def test_an_fp8_cache_packs_values_and_scales_into_its_rows():
    kv = cache(num_blocks=10, fp8=True)
    plain = cache(num_blocks=10)
    assert kv.k.dtype == torch.uint8 and kv.k.shape[-1] == 16 and kv.dtype == torch.float32  # 8 + 1, aligned
    assert [kv.blocks_at(p) for p in (4, 2, 1)] == [10, 21, 43]  # the view arithmetic of any cache
    assert kv.bytes_per_token() == 2 * 2 * T * 2 * 16 and kv.nbytes == plain.nbytes * 16 // 32
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(5, 2, 8, generator=g) * 10.0 ** torch.arange(-2, 3)[:, None, None] for _ in range(2))
    slots = torch.tensor([3, 17, 4, 30, 9])
    kv.write(1, 2, slots, k, v)
    got_k, got_v = kv.read(1, 2, slots)
    assert torch.equal(got_k, kv_quant.round_trip(k)) and torch.equal(got_v, kv_quant.round_trip(v))
    kv.write(1, 2, slots, got_k, got_v)  # values already rounded are stored as they are
    assert torch.equal(torch.stack(kv.read(1, 2, slots)), torch.stack([got_k, got_v]))
    kv.copy_slots([3, 17], [40, 41])  # prefix sharing: rows move whole, scales with them
    assert torch.equal(kv.read(1, 2, torch.tensor([40, 41]))[0], got_k[:2])
    kv.copy_forward(slots, 2)  # last-exited copies into plane 3
    assert torch.equal(kv.read(1, 3, slots)[1], got_v)


def test_bf16_names_the_cache_of_a_model_in_bf16():
    from ouro_cli.errors import SettingError
    from ouro_cli.settings import ExecutionSettings

    from .conftest import tiny_model

    with pytest.raises(SettingError, match="--kv-cache-dtype bf16 keeps K/V in the model's dtype"):
        LLM(tiny_model(0), kv_blocks=8, block_size=4, execution=ExecutionSettings(kv_cache_dtype="bf16"))
    llm = LLM(tiny_model(0).bfloat16(), kv_blocks=8, block_size=4, execution=ExecutionSettings(kv_cache_dtype="bf16"))
    assert llm.kv.k.dtype == torch.bfloat16 and not llm.kv.fp8
    llm.close()


def test_planes_change_only_while_no_block_is_used():
    kv = cache()
    kv.allocator.allocate(1)
    with pytest.raises(RuntimeError, match="blocks are in use"):
        kv.set_planes(2)


def test_restores_round_up_to_a_step_of_the_capacity():
    """Calls that differ by a few blocks restore one view (and so one layout for CUDA graphs);
    never less than asked, never more than the capacity."""
    assert [restore_blocks(b, 640) for b in (1, 10, 11, 20, 630, 640, 700)] == [10, 10, 20, 20, 630, 640, 640]
    assert [restore_blocks(b, 40) for b in (0, 1, 39, 40)] == [1, 1, 39, 40]  # under 64 blocks: a step of one
    kv = cache(num_blocks=10)
    assert [capacity_blocks(10, T, p, 4) for p in (4, 2, 1)] == [kv.blocks_at(p, capacity=True) for p in (4, 2, 1)]
    kv.release()
    kv.set_planes(2)
    kv.restore(blocks=5)
    assert kv.num_blocks == 5 and kv.layout[2:] == (2, 5) and not kv.fixed_address  # CPU: PyTorch allocates


def test_off_cuda_the_buffer_is_pytorch_allocated():
    from ouro_cli.engine.kv_memory import TorchBuffer, device_buffer

    buffer = device_buffer(64, torch.float32, torch.device("cpu"))
    assert isinstance(buffer, TorchBuffer) and not buffer.fixed_address
    assert not buffer.take(10).any()
    with pytest.raises(ValueError, match="needs a CUDA device"):
        device_buffer(64, torch.float32, torch.device("cpu"), fixed_address=True)


def test_release_and_restore():
    kv = cache()
    kv.k.fill_(1.0)
    kv.release()
    assert kv.released and kv.k is None
    kv.restore()
    assert not kv.released and kv.generation == 2 and float(kv.k.abs().sum()) == 0.0


@pytest.mark.parametrize(
    "k,execution",
    [(2, ExecutionSettings()), (3, ExecutionSettings()), (3, ExecutionSettings(exact=True, kv_cache_dtype="fp8"))],
)
def test_budget_view_with_exits_and_preemption_matches_replay(k, execution):
    """Threshold exits (mixed depths) under a K-plane view too small for every sequence at
    once: sequences are preempted, recomputed from their recorded depths, and still equal
    the replay (with an fp8 cache in exact mode, where a recomputed token's K/V round as they
    first did)."""
    model = tiny_model(0)
    model.execution = execution
    llm = LLM(model, max_num_seqs=6, kv_blocks=12, block_size=4)
    try:
        params = [
            SamplingParams(
                max_tokens=16, temperature=1.0, seed=s, logprobs=0, max_loops=k, exit_threshold=0.5, ignore_eos=True
            )
            for s in range(6)
        ]
        outs = llm.generate(prompts(6, seed=4), params)
        assert llm.kv.planes == k and llm.kv.k.shape[1] == k
        assert llm.work_counters()["preemptions"] > 0, "the cache should be too small to hold every sequence"
    finally:
        llm.close()
    depths = {d for o in outs for d in o.exit_depths[1:]}
    assert len(depths) >= 2 and max(depths) <= k
    assert max_replay_error(model, outs, 1.0) <= TOL


def test_two_planes_hold_twice_the_sequences(model):
    """A cache that holds one sequence at T planes decodes two at once at K = 2: half the steps."""
    per_seq = 4  # blocks of 4 tokens: prompts of <= 12 tokens + 4 new tokens
    params = SamplingParams(max_tokens=4, seed=0, logprobs=0, ignore_eos=True)
    runs = {}
    for k in (T, 2):
        llm = LLM(model, max_num_seqs=2, kv_blocks=per_seq, block_size=4)
        try:
            outs = llm.generate(prompts(2, seed=2, lo=12, hi=12), SamplingParams(**{**params.__dict__, "max_loops": k}))
            runs[k] = llm.work_counters()["decode_steps"]
        finally:
            llm.close()
        assert max_replay_error(model, outs, 1.0) <= TOL
    assert runs == {T: 6, 2: 3}  # 3 decode steps per sequence (the prefill samples token 0)


def test_release_memory_changes_no_output(model):
    llm = LLM(model, max_num_seqs=4, kv_blocks=32, block_size=4)
    try:
        params = SamplingParams(max_tokens=10, seed=3, logprobs=0, exit_threshold=0.5, ignore_eos=True)
        first = llm.generate(prompts(3, seed=1), params)
        llm.release_memory()
        assert llm.kv.released
        second = llm.generate(prompts(3, seed=1), params)  # restores on its own
        llm.release_memory()
        llm.restore_memory()
        third = llm.generate(prompts(3, seed=1), params)
    finally:
        llm.close()
    for a, b, c in zip(first, second, third, strict=True):
        assert a.output_token_ids == b.output_token_ids == c.output_token_ids
        assert a.log_probs == b.log_probs == c.log_probs and a.exit_depths == b.exit_depths == c.exit_depths


def test_a_released_cache_comes_back_as_large_as_the_call_needs(model):
    """After release_memory() a generate allocates only what its requests can ever hold (each
    one's prompt + max_tokens, a token in flight), at most the capacity, and gives the very
    outputs of a cache that was never released; a later call that needs more grows it."""
    params = SamplingParams(max_tokens=10, seed=3, logprobs=0, exit_threshold=0.5, ignore_eos=True)
    full = LLM(model, max_num_seqs=4, kv_blocks=200, block_size=4)
    trimmed = LLM(model, max_num_seqs=4, kv_blocks=200, block_size=4)
    try:
        reference = full.generate(prompts(3, seed=1), params)
        assert full.kv.num_blocks == 200 and full.kv.blocks_at(T, capacity=True) == 200
        trimmed.release_memory()
        outs = trimmed.generate(prompts(3, seed=1), params)
        ps = prompts(3, seed=1)
        need = sum(-(-(len(p) + 10 - 1 + 2) // 4) for p in ps)  # blocks of prompt + max_tokens - 1 + 2 tokens
        # rounded up to a step of the capacity (200 // 64 = 3 blocks): calls of one shape share a view
        assert trimmed.kv.num_blocks == restore_blocks(need, 200) == -(-need // 3) * 3 < 200
        assert trimmed.kv.nbytes < full.kv.nbytes
        for a, b in zip(reference, outs, strict=True):
            assert (a.output_token_ids, a.log_probs, a.exit_depths) == (b.output_token_ids, b.log_probs, b.exit_depths)
        longer = SamplingParams(**{**params.__dict__, "max_tokens": 30})
        more = trimmed.generate(prompts(4, seed=5), longer)
        assert trimmed.kv.num_blocks > need  # grown (the engine is idle between calls, nothing is lost)
        for a, b in zip(full.generate(prompts(4, seed=5), longer), more, strict=True):
            assert (a.output_token_ids, a.log_probs, a.exit_depths) == (b.output_token_ids, b.log_probs, b.exit_depths)
        trimmed.release_memory()
        trimmed.restore_memory()  # no call to size it: the whole capacity
        assert trimmed.kv.num_blocks == 200
    finally:
        full.close()
        trimmed.close()


class _Cache:
    """What ModelRunner reads of a cache to keep its graphs: the layout and whether it comes back."""

    def __init__(self, fixed_address: bool) -> None:
        self.fixed_address, self.layout, self.generation = fixed_address, (1, 2, 4, 10), 0


def _runner_with_graph_tables(cache) -> object:
    from ouro_cli.engine.runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # the table logic alone: no model, CPU
    runner.kv, runner.graphs, runner.prefill_graphs = cache, {}, {}
    runner._layouts, runner._layout = OrderedDict(), None
    runner.graph_pool = None
    return runner


def test_graph_tables_follow_the_cache_layout(monkeypatch):
    """A cache that keeps its addresses brings each layout back, and with it the graphs captured
    on it (a run cycling K = 2, 3, 4 keeps three tables); one whose address moves drops them."""
    from ouro_cli.engine.runner import KEPT_LAYOUTS

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)  # a fresh pool where graphs are dropped

    cache = _Cache(fixed_address=True)
    runner = _runner_with_graph_tables(cache)
    tables = {}
    for k in (2, 3, 4, 2, 3, 4):
        cache.layout = (1, 2, k, 100 // k)
        runner._graphs_for_layout()
        if k in tables:
            assert runner.graphs is tables[k] and runner.graphs == {"captured": k}
        else:
            runner.graphs["captured"] = k
            tables[k] = runner.graphs
    for extra in range(KEPT_LAYOUTS):  # older layouts give way to newer ones
        cache.layout = (1, 2, 1, extra)
        runner._graphs_for_layout()
    cache.layout = (1, 2, 2, 50)
    runner._graphs_for_layout()
    assert runner.graphs == {}

    moving = _Cache(fixed_address=False)
    runner = _runner_with_graph_tables(moving)
    runner._graphs_for_layout()
    runner.graphs["captured"] = 1
    first = moving.layout
    moving.layout = (5, 6, 4, 10)
    runner._graphs_for_layout()
    moving.layout = first
    runner._graphs_for_layout()
    assert runner.graphs == {}  # never kept: the addresses it was captured on may hold anything now
