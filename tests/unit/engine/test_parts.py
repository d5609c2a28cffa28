"""Unit checks of the engine's parts: sampler distribution and transforms, block
allocator, slot mapping and the last-exited plane copy, scheduler preemption order."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams
from ouro_cli.engine.kv_cache import BlockAllocator, PagedKVCache
from ouro_cli.engine.request_rng import RequestRng, next_keys, reference_uniform, uniform
from ouro_cli.engine.sampling import SamplingBatch, processed_logprobs, sample
from ouro_cli.engine.scheduler import Scheduler, Sequence

from .conftest import prompts, tiny_model


def _batch(n, temperature=1.0, top_k=-1, top_p=1.0, seed=0):
    rngs = [RequestRng(seed + i) for i in range(n)]
    return SamplingBatch([temperature] * n, [top_k] * n, [top_p] * n, rngs, torch.device("cpu"))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.6, -1, 1.0), (1.3, 5, 1.0), (0.9, -1, 0.7)])
def test_sampler_follows_the_processed_distribution(temperature, top_k, top_p):
    logits = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 2
    n = 20000
    batch = _batch(n, temperature, top_k, top_p)
    lp = processed_logprobs(logits.expand(n, 16), batch)
    tokens = sample(lp, batch)
    freq = torch.bincount(tokens, minlength=16).double() / n
    # independent fp64 reference of the processed distribution
    x = logits.double() / temperature
    order = torch.argsort(x, descending=True)
    keep = order[: top_k if top_k > 0 else 16]
    p = torch.softmax(x[keep], 0)
    keep = keep[(torch.cumsum(p, 0) - p) < top_p]
    ref = torch.zeros(16, dtype=torch.float64)
    ref[keep] = torch.softmax(x[keep], 0)
    assert torch.allclose(lp[0].double().exp(), ref, atol=1e-6)
    assert float((freq - ref).abs().sum()) < 0.05
    assert set(tokens.tolist()) <= set(keep.tolist())


def test_sampler_rows_use_only_their_own_stream():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    together = sample(processed_logprobs(logits, _batch(3, seed=10)), _batch(3, seed=10))
    alone = [
        int(
            sample(
                processed_logprobs(
                    logits[i : i + 1], b := SamplingBatch([1.0], [-1], [1.0], [RequestRng(10 + i)], torch.device("cpu"))
                ),
                b,
            )
        )
        for i in range(3)
    ]
    assert together.tolist() == alone


def test_request_rng_is_a_pure_function_of_seed_and_draw():
    a, b = RequestRng(7), RequestRng(7)
    keys = [a.next_key() for _ in range(3)]
    assert keys == [b.next_key() for _ in range(3)] and len(set(keys)) == 3 and a.draws == 3
    assert RequestRng(8).next_key() not in keys
    u = uniform(keys, 5000, "cpu")
    # the vectorized int64 hash equals the pure-Python one (wrap-around, logical shifts)
    assert [float(u[i, j]) for i in range(3) for j in (0, 1, 4999)] == [
        reference_uniform(k, j) for k in keys for j in (0, 1, 4999)
    ]
    assert 0 < float(u.min()) and float(u.max()) < 1
    # uniform on (0, 1): mean 1/2, variance 1/12, deciles near 1/10 each, draws uncorrelated
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert float((torch.histc(u, bins=10, min=0, max=1) / u.numel() - 0.1).abs().max()) < 0.01
    assert abs(float(torch.corrcoef(u[:2])[0, 1])) < 0.05


def test_a_batch_of_keys_is_each_streams_next_key():
    seeds = [0, 7, 2**63 + 5, 2**64 - 1, 123456789]
    one, batch = [RequestRng(s) for s in seeds], [RequestRng(s) for s in seeds]
    for r in one + batch:  # streams part-way through
        r.draws = r.seed % 5
    draw = [True, False, True, True, False]
    keys = next_keys(batch, draw)
    want = [r.next_key() if d else 0 for r, d in zip(one, draw, strict=True)]
    assert [int(k) % 2**64 for k in keys] == want  # the same 64 bits; a row that does not draw gets 0
    assert [r.draws for r in batch] == [r.draws for r in one]  # only the drawing streams advanced
    assert torch.equal(uniform(keys, 64, "cpu"), uniform(want, 64, "cpu"))


def test_allocator():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert a == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(RuntimeError):
        alloc.allocate(2)
    alloc.free(a[:1])
    with pytest.raises(RuntimeError, match="twice"):
        alloc.free(a[:1])
    assert sorted(alloc.allocate(2)) == [0, 3]


def test_slots_and_last_exited_copy():
    kv = PagedKVCache(
        num_layers=2,
        num_loops=4,
        num_blocks=4,
        block_size=2,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
    )
    assert kv.slots([3, 1], 0, 4) == [6, 7, 2, 3]
    slots, valid = kv.slot_table(torch.tensor([[3, 1]]), torch.tensor([3]), width=4)
    assert slots.tolist() == [[6, 7, 2, kv.scratch_slot]] and valid.tolist() == [[True, True, True, False]]
    s = torch.tensor([7])
    for plane in range(2):
        for layer in range(2):
            kv.write(layer, plane, s, torch.full((1, 1, 2), 10.0 * layer + plane), torch.full((1, 1, 2), -1.0 - plane))
    kv.copy_forward(s, last_plane=1)  # the token ran 2 loops: planes 3 and 4 hold plane 2
    assert kv.read(1, 3, s)[0].flatten().tolist() == [11.0, 11.0]
    assert [float(kv.read(1, p, s)[0][0, 0, 0]) for p in range(4)] == [10.0, 11.0, 11.0, 11.0]
    assert [float(kv.read(0, p, s)[1][0, 0, 0]) for p in range(4)] == [-1.0, -2.0, -2.0, -2.0]


def _seq(i, prompt_len, max_tokens):
    p = SamplingParams(max_tokens=max_tokens).resolved(4, 0)
    return Sequence(
        index=i,
        request_id=str(i),
        prompt=[1] * prompt_len,
        params=p,
        rng=RequestRng(0),
        max_kv_tokens=prompt_len + max_tokens - 1,
    )


def test_scheduler_preempts_the_youngest_and_requeues_in_order():
    alloc = BlockAllocator(6)
    sched = Scheduler(alloc, block_size=2, max_num_seqs=3, max_prefill_tokens=100)
    seqs = [_seq(i, 3, 10) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert plan.prefill == seqs and not plan.decode  # 2 blocks each (3 tokens + next input)
    for s in seqs:  # pretend each prefilled, sampled, decoded once: 4 cached, a third block needed
        s.num_cached, s.output, s.depths = 4, [5, 6], [4, 4]
    plan = sched.schedule()
    assert plan.decode == seqs[:2] and plan.preempted == [seqs[2]] and not plan.prefill
    assert list(sched.waiting) == [seqs[2]] and seqs[2].blocks == [] and seqs[2].num_cached == 0
    for s in seqs[:2]:
        s.num_cached = 6  # a fourth block each, none free: the younger gives way
    plan = sched.schedule()
    assert plan.decode == [seqs[0]] and plan.preempted == [seqs[1]]
    assert list(sched.waiting) == [seqs[1], seqs[2]]  # oldest first
    assert len(seqs[0].blocks) == 4 and alloc.num_free == 2


def test_decode_steps_are_counted_as_eager_without_graphs():
    llm = LLM(tiny_model(0), max_num_seqs=2, kv_blocks=32, block_size=4)
    llm.generate(prompts(2, seed=1), SamplingParams(max_tokens=5, seed=0, ignore_eos=True))
    counters = llm.work_counters()
    assert counters["decode_steps_eager"] == counters["decode_steps"] > 0 and counters["decode_steps_graphed"] == 0


def test_identical_prompts_share_one_prefill_bit_for_bit():
    """A GRPO group's copies of one prompt, admitted together, run one prefill; the others get
    its K/V by copy. Outputs equal those of sequences prefilled one by one (max_num_seqs 1)."""
    model = tiny_model(0)
    p, q = prompts(2, seed=3)
    batch = [p, p, q, p, q]
    params = [
        SamplingParams(max_tokens=8, seed=s, temperature=1.0, logprobs=0, exit_threshold=0.5, ignore_eos=True)
        for s in range(len(batch))
    ]
    runs = {}
    for n in (1, 5):
        llm = LLM(model, max_num_seqs=n, kv_blocks=64, block_size=4)
        runs[n] = (llm.generate(batch, params), llm.work_counters())
    (alone, c1), (shared, c5) = runs[1], runs[5]
    assert c1["prefill_tokens_shared"] == 0 and c5["prefill_tokens_shared"] == 2 * len(p) + len(q)
    assert c5["prefill_tokens"] == len(p) + len(q)
    for a, b in zip(alone, shared, strict=True):
        assert (a.output_token_ids, a.exit_depths, a.log_probs) == (b.output_token_ids, b.exit_depths, b.log_probs)
