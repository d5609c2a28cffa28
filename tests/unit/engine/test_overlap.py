"""Overlapped decoding (LLM(overlap=True), the CUDA default) queues step n + 1 before it
reads step n's tokens. It must give the outputs of stepping one at a time: a sequence
that ends on a stop token has run one step too many, which is discarded, and the batch
around it must not notice."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ouro_cli.engine import LLM, SamplingParams

from .conftest import prompts
from .test_scheduling import assert_same, params_mix

STOPS = tuple(range(0, 96, 9))  # ~1 token in 9 of the tiny vocabulary: most requests end early


def run(model, n: int, *, overlap: bool, stops: bool = True, **options):
    params = [
        dataclasses.replace(p, stop_token_ids=STOPS if stops and i % 3 else (), max_tokens=p.max_tokens + 6)
        for i, p in enumerate(params_mix(n))
    ]
    llm = LLM(model, overlap=overlap, **{"max_num_seqs": 8, "kv_blocks": 128, "block_size": 4, **options})
    try:
        return llm.generate(prompts(n, seed=3), params), llm.work_counters()
    finally:
        llm.close()


def serial_and_overlapped(model, reqs, params, **options):
    """(outputs, the decode batch of every step, work counters) of `reqs` stepped one at a time,
    then overlapped, on engines with `options`."""
    runs = []
    for overlap in (False, True):
        llm = LLM(model, overlap=overlap, **options)
        try:
            runs.append((llm.generate(reqs, params), llm.take_decode_batches(), llm.work_counters()))
        finally:
            llm.close()
    return runs


def test_overlap_gives_the_outputs_of_one_step_at_a_time(model):
    serial, c_serial = run(model, 8, overlap=False)
    overlapped, c = run(model, 8, overlap=True)
    assert_same(serial, overlapped)
    assert {o.finish_reason for o in serial} == {"stop", "length"}
    assert c_serial["decode_steps_overlapped"] == 0 and c["decode_steps_overlapped"] > 0
    assert c["decode_rows_discarded"] > 0  # stop tokens were met with a step in flight
    for key in ("decode_tokens", "decode_layer_tokens"):  # discarded rows are not counted as work done
        assert c[key] == c_serial[key], key
    # the host's waits for sampled tokens are counted (on CPU the tokens are there at once)
    assert isinstance(c["token_wait_us"], int) and 0 <= c["token_wait_us"] < 10**6
    assert c["decode_forward_gpu_us"] == c["decode_sample_gpu_us"] == 0  # CUDA events only (tests/gpu)


def test_overlap_with_a_queue_and_preemption(model):
    ample, _ = run(model, 7, overlap=False, max_num_seqs=4)
    queued, c = run(model, 7, overlap=True, max_num_seqs=4)
    assert_same(ample, queued)
    assert c["decode_steps_overlapped"] > 0
    tight, c = run(model, 7, overlap=True, max_num_seqs=4, kv_blocks=9)
    assert c["preemptions"] > 0
    assert_same(ample, tight, logprob_tol=1e-5)


def test_length_limits_end_a_run_without_a_discarded_step(model):
    serial, _ = run(model, 4, overlap=False, stops=False)
    overlapped, c = run(model, 4, overlap=True, stops=False)
    assert_same(serial, overlapped)
    assert c["decode_steps_overlapped"] > 0 and c["decode_rows_discarded"] == 0


def test_sequences_admitted_beside_a_decode_step_join_the_next_one(model):
    """A prefill budget of one prompt admits the queue over several steps; the last admission
    empties the queue while the earlier sequences decode. The overlapped run must then take the
    new ones into its next step (the batch changed), not keep stepping the old batch to its end
    and the new ones after it: as many decode steps as stepping one at a time, every one holding
    every running sequence once the queue is empty."""
    budget = max(len(p) for p in prompts(6, seed=3))
    params = [dataclasses.replace(p, max_tokens=12, ignore_eos=True) for p in params_mix(6)]
    (serial_outs, serial, _), (outs, overlapped, _) = serial_and_overlapped(
        model, prompts(6, seed=3), params, max_num_seqs=8, kv_blocks=128, block_size=4, max_prefill_tokens=budget
    )
    assert all(len(o.output_token_ids) == 12 for o in serial_outs + outs)
    assert len(overlapped) == len(serial) < 12 + 6, (serial, overlapped)
    assert overlapped == serial


@settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    distinct=st.integers(1, 4),
    group=st.integers(1, 3),
    tokens=st.lists(st.integers(1, 9), min_size=12, max_size=12),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 40),
    tight=st.booleans(),
    asynchronous=st.booleans(),
)
def test_overlap_decodes_the_batches_of_stepping_one_at_a_time(
    model, distinct, group, tokens, max_num_seqs, budget, tight, asynchronous
):
    """Over drawn queues (prompt copies that share blocks, response lengths, batch limits,
    prefill budgets, caches ample or tight enough to preempt, with or without asynchronous
    scheduling's delayed exits), the overlapped engine decodes the same rows in the same steps
    as one stepping one at a time, and gives the same outputs: overlap changes when the host
    works, never what a step holds. Responses end by length only (a stop token makes the
    overlapped run decode one discarded row, by design)."""
    base = prompts(distinct, seed=5)
    reqs = [p for p in base for _ in range(group)]
    params = [
        SamplingParams(max_tokens=tokens[i], seed=i, logprobs=0, ignore_eos=True, exit_threshold=0.5)
        for i in range(len(reqs))
    ]
    longest = max(len(p) + t for p, t in zip(reqs, tokens, strict=False))
    kv_blocks = -(-longest // 4) + 2 if tight else 128
    runs = serial_and_overlapped(
        model,
        reqs,
        params,
        max_num_seqs=max_num_seqs,
        kv_blocks=kv_blocks,
        block_size=4,
        max_prefill_tokens=budget,
        async_scheduling=asynchronous,
    )
    (serial, serial_batches, c_serial), (overlapped, batches, c) = runs
    assert_same(serial, overlapped, logprob_tol=0.0)
    assert batches == serial_batches
    assert c["preemptions"] == c_serial["preemptions"]


def test_a_queue_waiting_for_blocks_does_not_stop_the_overlap(model):
    """Sequences that wait because the cache is full (not the batch) cannot be admitted before
    a running one ends; until then the overlapped run keeps queueing steps ahead
    (`Scheduler.may_admit` says no admission is possible) instead of scheduling each step
    afresh. The steps and outputs stay those of stepping one at a time."""
    params = [SamplingParams(max_tokens=16, seed=i, logprobs=0, ignore_eos=True) for i in range(4)]
    reqs = prompts(4, seed=7, lo=4, hi=4)
    (serial, serial_batches, _), (overlapped, batches, c) = serial_and_overlapped(
        model, reqs, params, max_num_seqs=4, kv_blocks=12, block_size=4
    )
    assert_same(serial, overlapped, logprob_tol=0.0)
    assert batches == serial_batches and c["preemptions"] > 0, batches  # the cache holds fewer than all four
    # the batch changes at 4 of its 22 steps here: the others are queued ahead
    assert 4 * c["decode_steps_overlapped"] >= 3 * len(batches), (c["decode_steps_overlapped"], batches)
