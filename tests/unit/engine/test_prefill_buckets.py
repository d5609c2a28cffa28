"""A fresh prompt prefilled at its bucket width (what the engine does on CUDA, where the
bucket is a captured graph; runner.py `prefill`), checked on CPU by turning the buckets on
here: the padding after the prompt writes only the scratch slot and changes nothing the
prompt's positions compute but a GEMM's row count, so tokens, depths and fp32 logprobs are
the unpadded run's (to rounding) and the replay's; the executed-work counter counts the
padding; in exact mode the logprobs stay the replay's bits."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams, runner
from ouro_cli.engine.runner import prefill_bucket

from .conftest import prompts, tiny_model
from .test_exact_engine import EXACT, _max_mismatch
from .test_replay import max_replay_error

PARAMS = [SamplingParams(max_tokens=10, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True) for s in range(5)]


def _generate(model, **options):
    llm = LLM(model, max_num_seqs=4, kv_blocks=64, block_size=4, **options)
    try:
        return llm.generate(prompts(5, seed=1), PARAMS), llm.work_counters()
    finally:
        llm.close()


@pytest.fixture
def buckets_on_cpu(monkeypatch):
    monkeypatch.setattr(runner, "BUCKETED_PREFILL", ("cpu", "cuda"))


def test_bucket_widths():
    assert [prefill_bucket(n) for n in (1, 16, 17, 100, 512)] == [16, 16, 32, 128, 512]


def test_a_bucketed_prefill_gives_the_unpadded_results(request):
    model = tiny_model(0)
    plain, plain_counters = _generate(model)
    request.getfixturevalue("buckets_on_cpu")
    padded, counters = _generate(model)
    assert len({d for o in padded for d in o.exit_depths[1:]}) >= 3, "the gate should give mixed depths"
    for a, b in zip(padded, plain, strict=True):
        assert (a.output_token_ids, a.exit_depths) == (b.output_token_ids, b.exit_depths)
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) <= 1e-5
    assert max_replay_error(model, padded, 1.0) <= 1e-5
    work = len(model.model.layers) * model.num_loops
    assert counters["prefill_layer_tokens"] == plain_counters["prefill_layer_tokens"]
    assert counters["prefill_layer_tokens_executed"] == sum(prefill_bucket(len(p)) for p in prompts(5, seed=1)) * work
    assert plain_counters["prefill_layer_tokens_executed"] == plain_counters["prefill_layer_tokens"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bucketed_prefill_stays_exact(buckets_on_cpu, dtype):
    model = tiny_model(0).to(dtype)
    outs, counters = _generate(model, execution=EXACT)
    assert counters["prefill_layer_tokens_executed"] > counters["prefill_layer_tokens"]  # it did pad
    assert _max_mismatch(model, outs) == 0.0
