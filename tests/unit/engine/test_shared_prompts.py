"""Shared prompt blocks (engine/scheduler.py): the samples of a group read one copy of their
prompt's full KV blocks, and every output is the one private copies give.

The engine runs the same requests with sharing on and off (`LLM(share_prompts=...)`). In exact
mode a request's outputs do not depend on the schedule, preemptions and recomputes included
(docs/exact.md), so under a cache tight enough to preempt in both runs (which it does at other
steps: sharing admits more) the outputs must agree bit for bit: a sample that wrote into a
shared block, read a block another sequence reused, or copied the wrong part of the prompt
would change them. In the default mode a preempted sequence's recompute rounds its K/V
differently (test_scheduling.py), so there the runs agree bit for bit where the schedule is
the same and otherwise in tokens and depths, with the trainer's replay to 1e-5.
The allocator and the scheduler are checked on their own with drawn request mixes (hypothesis).
"""

from __future__ import annotations

import random

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams
from ouro_cli.engine.kv_cache import BlockAllocator, group_blocks, most_call_blocks, prompt_blocks
from ouro_cli.engine.request_rng import RequestRng
from ouro_cli.engine.scheduler import Scheduler, Sequence

from .conftest import tiny_model
from .test_replay import max_replay_error

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BS = 4  # block size: prompts of 4 and 8 tokens fill their blocks, 3 and 7 end in a partial one
SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def group_requests(group: int, lengths: list[int], seed: int = 0):
    """`group` samples of each prompt, in groups (as a rollout submits them), with mixed exit
    rules and response lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in lengths]
    modes = [dict(exit_threshold=0.5), dict(max_loops=3), dict(exit_threshold=0.45, exit_mode="delayed")]
    requests = [p for p in prompts for _ in range(group)]
    params = [
        SamplingParams(max_tokens=4 + i % 4, seed=500 + i, logprobs=0, ignore_eos=True, **modes[i % len(modes)])
        for i in range(len(requests))
    ]
    return requests, params


def generate(model, requests, params, *, share: bool, kv_blocks: int, exact: bool = False):
    llm = LLM(model, max_num_seqs=16, kv_blocks=kv_blocks, block_size=BS, exact=exact, share_prompts=share)
    try:
        outs = llm.generate(requests, params)
        assert llm.kv.allocator.num_free == llm.kv.num_blocks  # every reference given back
        return outs, llm.work_counters()
    finally:
        llm.close()


def results(outs):
    return [(o.output_token_ids, o.exit_depths, o.log_probs, o.finish_reason) for o in outs]


@pytest.mark.parametrize(("group", "lengths"), [(4, [8, 7, 4, 3]), (8, [4, 7, 5]), (16, [8, 3])])
def test_shared_blocks_give_the_outputs_of_private_copies_bit_for_bit(model, group, lengths):
    requests, params = group_requests(group, lengths)
    runs = {share: generate(model, requests, params, share=share, kv_blocks=14, exact=True) for share in (False, True)}
    (private, c0), (shared, c1) = runs[False], runs[True]
    assert c0["preemptions"] > 0 and c1["preemptions"] > 0  # the cache is tight for both
    assert results(shared) == results(private)
    assert c1["prefill_tokens_shared"] > c0["prefill_tokens_shared"]  # members joined live groups


def test_default_mode_same_schedule_bit_for_bit_and_a_smaller_cache(model):
    """With room for the whole call both runs schedule alike: the same bits. A released cache
    comes back only as large as the call needs, which sharing makes smaller."""
    requests, params = group_requests(8, [8, 7, 5])
    runs = {}
    for share in (False, True):
        llm = LLM(model, max_num_seqs=16, kv_blocks=400, block_size=BS, share_prompts=share)
        try:
            llm.release_memory()
            runs[share] = (llm.generate(requests, params), llm.kv.num_blocks, llm.work_counters())
        finally:
            llm.close()
    (private, blocks0, c0), (shared, blocks1, c1) = runs[False], runs[True]
    assert c0["preemptions"] == c1["preemptions"] == 0
    assert results(shared) == results(private)
    assert blocks1 < blocks0


def test_default_mode_tight_cache_matches_in_tokens_and_replay(model):
    """Preempted at other steps, the default mode's recomputes round the K/V differently; the
    tokens and depths still agree, and every logprob is the trainer's replay's."""
    requests, params = group_requests(4, [8, 7, 4, 3])
    (private, c0), (shared, c1) = (generate(model, requests, params, share=s, kv_blocks=14) for s in (False, True))
    assert c0["preemptions"] > 0 and c1["preemptions"] > 0
    for a, b in zip(private, shared, strict=True):
        assert (a.output_token_ids, a.exit_depths) == (b.output_token_ids, b.exit_depths)
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) <= 1e-5
    assert max_replay_error(model, shared, 1.0) <= 1e-5


# ---- the allocator and the scheduler alone ------------------------------------------------


def test_allocator_counts_references():
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    assert alloc.share(a) == a and alloc.references(a[0]) == 2 and alloc.num_free == 2
    alloc.free(a)  # one owner gone: the other still holds them
    assert alloc.num_free == 2 and alloc.references(a[1]) == 1
    alloc.free(a)
    assert alloc.num_free == 4 and alloc.references(a[0]) == 0
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(a[:1])
    with pytest.raises(RuntimeError, match="shared while free"):
        alloc.share(a[:1])
    alloc.share(alloc.allocate(1))
    alloc.reset()  # release/restore and invalidate: every reference dropped
    assert alloc.num_free == 4 and alloc.references(0) == 0


@SETTINGS
@given(st.data())
def test_allocator_never_leaks_or_double_frees(data):
    """Drawn allocate / share / free sequences against a plain count of references."""
    n = data.draw(st.integers(1, 12))
    alloc, owners = BlockAllocator(n), []  # owners: each one's list of blocks
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["allocate", "share", "free"]))
        if op == "allocate":
            k = data.draw(st.integers(0, n))
            if k > alloc.num_free:
                with pytest.raises(RuntimeError):
                    alloc.allocate(k)
            else:
                owners.append(alloc.allocate(k))
        elif op == "share" and owners:
            source = data.draw(st.sampled_from(owners))
            owners.append(alloc.share(source[: data.draw(st.integers(0, len(source)))]))
        elif op == "free" and owners:
            alloc.free(owners.pop(data.draw(st.integers(0, len(owners) - 1))))
        held = [b for blocks in owners for b in blocks]
        assert alloc.num_free == n - len(set(held))
        assert all(alloc.references(b) == held.count(b) for b in range(n))
    for blocks in owners:
        alloc.free(blocks)
    assert alloc.num_free == n


def _sequence(index: int, prompt: list[int], max_tokens: int, group: int | None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens).resolved(4, 0)
    return Sequence(
        index=index,
        request_id=str(index),
        prompt=prompt,
        params=params,
        rng=RequestRng(0),
        max_kv_tokens=len(prompt) + max_tokens - 1,
        group=group,
    )


def _check_blocks(sched: Scheduler, alloc: BlockAllocator, block_size: int) -> None:
    """Every block's references are its running owners, and a block two of them hold is a full
    prompt block of one group at the same place in both: nobody writes into a shared block."""
    owners: dict[int, list[tuple[Sequence, int]]] = {}
    for seq in sched.running:
        assert len(seq.blocks) == len(set(seq.blocks))
        for i, b in enumerate(seq.blocks):
            owners.setdefault(b, []).append((seq, i))
    assert alloc.num_free == alloc.num_blocks - len(owners)
    for b, held in owners.items():
        assert alloc.references(b) == len(held)
        if len(held) > 1:
            (first, at), *rest = held
            assert at < prompt_blocks(len(first.prompt), block_size)
            assert all(s.group == first.group is not None and i == at for s, i in rest)


@SETTINGS
@given(st.data())
def test_scheduler_shares_and_returns_every_block(data):
    """Groups of requests stepped through the scheduler as the engine core steps them (prefill,
    decode one token, finish at max_tokens or at a drawn stop), in a cache small enough to
    preempt: references stay exact at every step, and all blocks come back at the end. A
    scheduler that reserves blocks at admission never preempts."""
    block_size = data.draw(st.integers(1, 4))
    groups = data.draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 5)), min_size=1, max_size=4))
    max_tokens = data.draw(st.integers(1, 10))
    stops = random.Random(data.draw(st.integers(0, 2**16)))  # which tokens end a sequence early
    seqs: list[Sequence] = []
    for g, (length, size) in enumerate(groups):
        prompt = [g + 1] * length
        for _ in range(size):
            seqs.append(_sequence(len(seqs), prompt, max_tokens, g))
    longest = max(blocks for blocks in (-(-(s.max_kv_tokens + 1) // block_size) for s in seqs))
    alloc = BlockAllocator(data.draw(st.integers(longest, longest + 6)))
    reserve = data.draw(st.booleans())
    sched = Scheduler(
        alloc, block_size, max_num_seqs=data.draw(st.integers(1, 8)), max_prefill_tokens=16, reserve=reserve
    )
    for seq in seqs:
        sched.add(seq)
    preempted = shared = 0
    for _ in range(500):
        if not sched.has_work():
            break
        plan = sched.schedule()
        preempted += len(plan.preempted)
        assert plan.prefill or plan.decode
        for seq in plan.prefill:
            donor = seq.prompt_donor
            if donor is not None:  # the core's copy source: a running holder of the same prompt
                assert donor in sched.running and donor.prompt == seq.prompt and seq.prompt_only
                seq.prompt_donor = None
                shared += 1
            seq.num_cached = len(seq.prefill_tokens)
        for seq in plan.decode:
            seq.num_cached += 1
        for seq in [s for s in plan.prefill if s.is_fresh] + plan.decode:
            seq.output.append(7)
            seq.depths.append(4)
            if len(seq.output) >= max_tokens or stops.random() < 0.05:
                sched.finish(seq)
        _check_blocks(sched, alloc, block_size)
    assert not sched.has_work() and alloc.num_free == alloc.num_blocks and not sched.holders
    assert not (reserve and preempted)  # reserving admission never preempts
    event(f"reserve: {reserve}, preempted: {preempted > 0}, shared: {shared > 0}")


def test_a_preempted_member_drops_only_its_references():
    """Two samples of a 7-token prompt (one full block of 4, then 3 tokens) share the full
    block; preempting the younger frees its own blocks only. Back with generated tokens to
    recompute, it prefills into blocks of its own."""
    alloc = BlockAllocator(4)
    sched = Scheduler(alloc, block_size=4, max_num_seqs=2, max_prefill_tokens=100)
    a, b = (_sequence(i, [3] * 7, 8, 0) for i in range(2))
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan.prefill == [a, b] and b.prompt_donor is a and a.prompt_donor is None
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1] and alloc.num_free == 1
    for s in (a, b):  # prefilled, token 0 sampled, one decode step: a third block each
        s.prompt_donor, s.num_cached, s.output, s.depths = None, 8, [5, 6], [4, 4]
    plan = sched.schedule()
    assert plan.decode == [a] and plan.preempted == [b] and b.blocks == []
    assert alloc.references(a.blocks[0]) == 1 and len(a.blocks) == 3 and alloc.num_free == 1
    assert sched.holders == {0: [a]}
    sched.finish(a)
    plan = sched.schedule()
    assert plan.prefill == [b] and b.prompt_donor is None and len(b.blocks) == 3 and not sched.holders


def test_call_bound_holds_any_grouping():
    """`most_call_blocks` bounds the engine's count (`group_blocks`) for every split of a call's
    requests into groups and every prompt up to the longest, and some split reaches it."""
    for bs in (1, 3, 4):
        for longest in range(1, 10):
            for sizes in ([1], [3], [2, 2], [1, 4], [3, 1, 2]):
                bound = most_call_blocks(sum(sizes), len(sizes), longest, 5, 0, bs)
                counts = {m: sum(group_blocks(m, [(m + 4, 0)] * g, bs) for g in sizes) for m in range(1, longest + 1)}
                assert max(counts.values()) == bound
