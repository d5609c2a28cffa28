"""Fresh prompts prefilled at their bucket width, in groups of rows of one width (what the
engine does on CUDA, where a group is a captured graph; runner.py `prefill_many`), checked on
CPU by turning the buckets on here: the padding after a prompt, and the rows of padding that
fill a group, write only the scratch slot and change nothing the prompt's positions compute
but a GEMM's row count, so tokens, depths and fp32 logprobs are the unpadded run's (to
rounding) and the replay's; a prompt gets the same bits (logits and every K/V plane) alone
or among others; the executed-work counter counts the padding (and the groups: bf16 only,
fp32 prefills each prompt alone); in exact mode the logprobs stay the replay's bits."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams, runner
from ouro_cli.engine.runner import PrefillItem, prefill_bucket, prefill_group

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
    # fp32: each of the 5 prompts of width 16 alone, padded to its bucket width
    assert {prefill_bucket(len(p)) for p in prompts(5, seed=1)} == {16}
    assert counters["prefill_layer_tokens_executed"] == 5 * 16 * work
    assert plain_counters["prefill_layer_tokens_executed"] == plain_counters["prefill_layer_tokens"]


def test_bf16_prefills_prompts_in_groups_and_fp32_alone(buckets_on_cpu):
    """bf16: two groups of width 16 (4 prompts admitted in the first step, 1 in a later one),
    each filled up with rows of padding to `prefill_group` rows; fp32: one row per prompt
    (grouped, fp32 agreement with the trainer at 1.4B was worse: runner.prefill_group)."""
    assert prefill_group(16, torch.bfloat16) == runner.MAX_PREFILL_GROUP > 1
    assert prefill_group(16, torch.float32) == 1
    assert prefill_group(2048, torch.bfloat16) == 1
    for dtype, rows in ((torch.bfloat16, 2 * prefill_group(16, torch.bfloat16)), (torch.float32, 5)):
        model = tiny_model(0).to(dtype)
        _, counters = _generate(model)
        work = len(model.model.layers) * model.num_loops
        assert counters["prefill_layer_tokens_executed"] == rows * 16 * work, dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bucketed_prefill_stays_exact(buckets_on_cpu, dtype):
    model = tiny_model(0).to(dtype)
    outs, counters = _generate(model, execution=EXACT)
    assert counters["prefill_layer_tokens_executed"] > counters["prefill_layer_tokens"]  # it did pad
    assert _max_mismatch(model, outs) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_prefills_to_the_same_bits_alone_or_in_a_group(buckets_on_cpu, monkeypatch, dtype):
    """The PD prefill worker prefills one prompt at a time, the local engine a step's prompts
    together: both must write the same K/V and give the same logits (fp32 grouped here too,
    as it would be with a larger MAX_PREFILL_GROUP_FP32)."""
    monkeypatch.setattr(runner, "MAX_PREFILL_GROUP_FP32", runner.MAX_PREFILL_GROUP)
    model = tiny_model(0).to(dtype)
    llm = LLM(model, max_num_seqs=8, kv_blocks=64, block_size=4)
    prefiller, kv = llm.core.runner, llm.core.kv
    t = model.num_loops
    items = [
        PrefillItem(p, [t] * len(p), list(range(16 * i, 16 * i + len(p)))) for i, p in enumerate(prompts(6, seed=2))
    ]
    used = 16 * len(items)
    try:
        together = prefiller.prefill_many(items)
        planes = kv.k[..., :used, :].clone(), kv.v[..., :used, :].clone()
        kv.k.zero_(), kv.v.zero_()
        alone = [prefiller.prefill(item) for item in reversed(items)][::-1]
        for a, b in zip(together, alone, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(planes[0], kv.k[..., :used, :]) and torch.equal(planes[1], kv.v[..., :used, :])
        assert planes[0].abs().sum() > 0
    finally:
        llm.close()
