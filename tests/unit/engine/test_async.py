"""Asynchronous scheduling (async_exits.py): loops queued ahead of the exit read, delayed exits.

- The host reads the exit flag of loop t only after loop t + 1 has been queued.
- Threshold requests run the delayed policy (their effective params say so) and give
  the very outputs, and loop counts, of a synchronous engine running exit_mode "delayed".
- The outputs replay in the trainer (fp32, <= 1e-5) with mixed exit depths.
"""

from __future__ import annotations

import pytest

from ouro_cli.engine import LLM, SamplingParams, async_exits
from ouro_cli.engine.runner import TIMINGS

from .conftest import prompts
from .test_replay import max_replay_error
from .test_scheduling import assert_same

T = 4


def threshold_params(mode: str, n: int = 6) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=12 + i % 3,
            temperature=0.9,
            seed=40 + i,
            logprobs=0,
            exit_threshold=0.5,
            exit_mode=mode,
            min_loops=1 + i % 2,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def generate(model, params, **options):
    llm = LLM(model, max_num_seqs=4, kv_blocks=128, block_size=4, **options)
    try:
        outs = llm.generate(prompts(len(params), seed=6), params)
        return outs, {k: v for k, v in llm.work_counters().items() if k not in TIMINGS}  # the work, not its time
    finally:
        llm.close()


def test_async_outputs_match_the_trainer_replay(model):
    outs, _ = generate(model, threshold_params("immediate"), async_scheduling=True)
    assert all(o.sampling_params.exit_mode == "delayed" for o in outs)  # forced, and reported
    depths = {d for o in outs for d in o.exit_depths[1:]}
    assert len(depths) >= 3, depths
    for out in outs:
        assert out.exit_depths[0] == T
        assert min(out.exit_depths[1:]) >= out.sampling_params.min_loops + 1  # one loop late
    assert max_replay_error(model, outs, 0.9) <= 1e-5


def test_async_equals_synchronous_delayed_exits(model):
    sync, sync_counters = generate(model, threshold_params("delayed"))
    asyn, async_counters = generate(model, threshold_params("immediate"), async_scheduling=True)
    assert_same(sync, asyn, logprob_tol=0.0)
    # the same loops ran: reading the signal late costs no extra loop under the delayed policy
    assert async_counters == sync_counters
    assert sync_counters["decode_layer_tokens_executed"] < sync_counters["decode_steps"] * 8 * T * 2


def test_the_exit_flag_is_read_after_the_next_loop_is_queued(model, monkeypatch):
    events: list[str] = []
    record, done = async_exits.LaggedExitProbe.record, async_exits.LaggedExitProbe.everyone_done

    def logged_record(self, exits, t):
        events.append("record")
        record(self, exits, t)

    def logged_done(self):
        events.append("read" if self._flag is not None else "read-nothing")
        return done(self)

    monkeypatch.setattr(async_exits.LaggedExitProbe, "record", logged_record)
    monkeypatch.setattr(async_exits.LaggedExitProbe, "everyone_done", logged_done)
    run_loop = model.run_loop
    monkeypatch.setattr(model, "run_loop", lambda *a: (events.append("loop"), run_loop(*a))[1])
    generate(model, threshold_params("delayed", n=3), async_scheduling=True)
    reads = [i for i, e in enumerate(events) if e == "read"]
    assert reads, "the async path never read an exit flag"
    for i in reads:  # record (after loop t) -> loop t + 1 queued -> read
        assert events[i - 2 : i] == ["record", "loop"], events[i - 3 : i + 1]


def test_fixed_budgets_and_traces_are_unchanged(model):
    params = [
        SamplingParams(max_tokens=10, seed=1, logprobs=0, max_loops=3, ignore_eos=True),
        SamplingParams(max_tokens=10, seed=2, logprobs=0, exit_mode="trace", exit_trace=(2, 1, 4), ignore_eos=True),
    ]
    sync, _ = generate(model, params)
    asyn, _ = generate(model, params, async_scheduling=True)
    assert_same(sync, asyn, logprob_tol=0.0)
    assert asyn[0].sampling_params.exit_mode == "immediate"  # τ = 1: nothing to delay
    assert max_replay_error(model, asyn, 1.0) <= 1e-5


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_async_batching_does_not_change_outputs(model, max_num_seqs):
    ref, _ = generate(model, threshold_params("delayed"))
    llm = LLM(model, max_num_seqs=max_num_seqs, kv_blocks=128, block_size=4, async_scheduling=True)
    try:
        outs = llm.generate(prompts(6, seed=6), threshold_params("immediate"))
    finally:
        llm.close()
    assert_same(ref, outs)


@pytest.mark.gpu
def test_cuda_async_equals_synchronous_delayed_exits():
    from .conftest import tiny_model

    model = tiny_model(0).cuda()
    sync, sync_counters = generate(model, threshold_params("delayed"), cuda_graphs=False)
    asyn, async_counters = generate(model, threshold_params("immediate"), cuda_graphs=False, async_scheduling=True)
    assert_same(sync, asyn, logprob_tol=1e-6)
    assert async_counters == sync_counters
    assert max_replay_error(model, asyn, 0.9) <= 1e-5
