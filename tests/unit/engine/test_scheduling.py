"""Scheduling never changes results: same seeds and configuration give identical outputs
across runs and batch sizes, preemption under a tight KV budget gives the outputs of an
ample one, and a request that can never fit is rejected up front."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import LLM, RequestRejected, SamplingParams

from .conftest import prompts, tiny_model
from .test_replay import max_replay_error


def params_mix(n: int) -> list[SamplingParams]:
    modes = [
        dict(exit_threshold=0.5),
        dict(max_loops=3),
        dict(exit_threshold=0.45, exit_mode="delayed"),
        dict(max_loops=2, top_k=20),
        dict(exit_threshold=0.5, top_p=0.9),
    ]
    return [
        SamplingParams(max_tokens=8 + 2 * (i % 4), seed=100 + i, logprobs=0, ignore_eos=True, **modes[i % len(modes)])
        for i in range(n)
    ]


def generate(make_engine, model, *, max_num_seqs=4, kv_blocks=128, block_size=4, n=7, **options):
    llm = make_engine(model, max_num_seqs=max_num_seqs, kv_blocks=kv_blocks, block_size=block_size, **options)
    try:
        return llm.generate(prompts(n, seed=2), params_mix(n)), llm.work_counters()
    finally:
        llm.close()


def assert_same(a, b, logprob_tol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.prompt_token_ids == y.prompt_token_ids
        assert x.output_token_ids == y.output_token_ids
        assert x.exit_depths == y.exit_depths
        assert x.finish_reason == y.finish_reason
        assert x.sampling_params == y.sampling_params
        assert float((torch.tensor(x.log_probs) - torch.tensor(y.log_probs)).abs().max()) <= logprob_tol


def test_same_seeds_same_outputs(make_engine, model):
    a, _ = generate(make_engine, model)
    b, _ = generate(make_engine, model)
    assert_same(a, b, logprob_tol=0.0)


def test_batch_size_does_not_change_outputs(make_engine, model):
    one, _ = generate(make_engine, model, max_num_seqs=1)
    four, _ = generate(make_engine, model, max_num_seqs=4)
    assert_same(one, four)
    assert len({d for o in four for d in o.exit_depths[1:]}) >= 3


def test_outputs_in_input_order(make_engine, model):
    outs, _ = generate(make_engine, model)
    assert [o.prompt_token_ids for o in outs] == prompts(7, seed=2)


def test_preemption_gives_the_same_outputs(make_engine, model):
    ample, counters = generate(make_engine, model, kv_blocks=128)
    assert counters.get("preemptions", 0) == 0
    # 7 requests of up to 12 + 14 tokens with 4-token blocks: 9 blocks hold one or two at a time.
    tight, counters = generate(make_engine, model, kv_blocks=9)
    if "preemptions" in counters:
        assert counters["preemptions"] > 0
    assert_same(ample, tight, logprob_tol=1e-5)
    for out in tight:  # recomputed sequences still match the trainer's replay
        p = out.sampling_params
        if p.top_k == -1 and p.top_p == 1.0:
            assert max_replay_error(model, [out], p.temperature) <= 1e-5


def test_request_that_can_never_fit_is_rejected(make_engine, model):
    llm = make_engine(model, max_num_seqs=2, kv_blocks=3, block_size=4)
    try:
        with pytest.raises(RequestRejected, match="can never fit"):
            llm.generate([[1, 2, 3], list(range(1, 11))], SamplingParams(max_tokens=4))
        # nothing was admitted: the engine still serves requests that fit
        (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10, seed=0))
        assert len(out.output_token_ids) <= 10
    finally:
        llm.close()


def test_request_longer_than_the_model_is_rejected(make_engine, model):
    llm = make_engine(model, max_num_seqs=1, kv_blocks=256, block_size=4)
    try:
        with pytest.raises(RequestRejected, match="max_model_len"):
            llm.generate([[1] * 500], SamplingParams(max_tokens=20))
    finally:
        llm.close()


def test_seed_none_is_drawn_and_replays(make_engine, model):
    llm = make_engine(model, max_num_seqs=2, kv_blocks=64, block_size=4)
    try:
        (first,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, logprobs=0))
        seed = first.sampling_params.seed
        assert isinstance(seed, int)
        (again,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, logprobs=0, seed=seed))
        assert again.output_token_ids == first.output_token_ids
        assert again.log_probs == first.log_probs
    finally:
        llm.close()


def test_cache_that_fits_one_request_at_a_time(make_engine, model):
    """The tightest legal cache (the largest request's own need) still completes every
    request with the ample results, and gives every block back."""
    ample, _ = generate(make_engine, model, kv_blocks=128)
    need = max(len(o.prompt_token_ids) + o.sampling_params.max_tokens - 1 for o in ample)
    tight, counters = generate(make_engine, model, kv_blocks=-(-need // 4))
    assert_same(ample, tight, logprob_tol=1e-5)
    if "preemptions" in counters:
        assert counters["preemptions"] > 0


def test_blocks_are_returned(model):
    from ouro_cli.engine import LLM

    llm = LLM(model, max_num_seqs=3, kv_blocks=9, block_size=4)
    llm.generate(prompts(7, seed=2), params_mix(7))
    assert llm.kv.allocator.num_free == llm.kv.num_blocks


def test_reserving_admission_never_preempts(model):
    """A cache that holds one or two requests at a time (as above): admitting whoever fits now
    preempts running requests later and recomputes them; reserving at admission every block a
    request may come to hold admits fewer at once and never preempts. In exact mode the outputs
    are the same bits either way."""
    from ouro_cli.engine import LLM

    eager, c0 = generate(LLM, model, kv_blocks=9, exact=True)
    held, c1 = generate(LLM, model, kv_blocks=9, exact=True, reserve_blocks=True)
    assert c0["preemptions"] > 0 and c1["preemptions"] == 0
    assert c1["prefill_tokens"] == sum(map(len, prompts(7, seed=2)))  # nobody recomputed
    assert_same(eager, held, logprob_tol=0.0)


def test_the_engine_lists_each_decode_steps_rows():
    """`take_decode_batches`: the rows of every decode step since the last call (the batch over
    time an update reports), each decoded row once."""
    llm = LLM(tiny_model(0), max_num_seqs=3, kv_blocks=64, block_size=4)
    lengths = [2, 5, 3, 6]
    params = [SamplingParams(max_tokens=n, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    before = llm.work_counters()["decode_tokens"]
    llm.generate([[5, 6, 7]] * len(lengths), params)
    batches = llm.take_decode_batches()
    assert sum(batches) == llm.work_counters()["decode_tokens"] - before  # every decoded row, once
    assert max(batches) <= 3 and len(batches) == llm.work_counters()["decode_steps"]
    assert llm.take_decode_batches() == []  # taken: forgotten
