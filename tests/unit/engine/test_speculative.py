"""Self-speculative decoding (speculative.py): exact target sampling, replayable outputs.

- Distribution: over many seeds, the marginals of the first tokens a speculative step
  emits (out[1], a draft or a correction; out[2], a second draft, a correction or the
  bonus) match the full-depth target, computed exactly from the model's dense forward
  (chi-square). A broken acceptance rule (always accept) is caught by the same test.
- Replay: every emitted token reports depth T and the target's processed logprob, which
  equals the trainer replay with depths all T (fp32, <= 1e-5); with an fp8 KV cache too, whose
  verified planes hold the K/V the replay rounds.
- Scheduling never changes results, counters count every row, incompatible params fail.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ouro_cli.engine import LLM, RequestRejected, SamplingParams, speculative
from ouro_cli.model import build, tiny_config

from .conftest import prompts
from .test_replay import max_replay_error
from .test_scheduling import assert_same

T = 4
V = 16  # a small vocabulary: the chi-square test has few cells
TEMP = 0.8
PROMPT = [3, 7, 1, 12, 5]
SAMPLES = 1500


@pytest.fixture(scope="module")
def small_vocab_model():
    """Draft (2 loops) and target (4 loops) differ clearly here: the marginal of out[1]
    differs by total variation ≈ 0.44, so a wrong acceptance rule cannot hide."""
    return build(tiny_config(vocab_size=V), dtype=torch.float32, seed=0, std=0.12)


def target_marginals(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact marginals of out[1] and out[2] under full-depth sampling at TEMP (fp64 sums of the
    dense model's probabilities: p(a) p(b|a) p(c|a,b) over every a, b)."""

    def probs(seqs: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(seqs))[:, -1].double()
        return torch.softmax(logits / TEMP, dim=-1)

    p0 = probs([PROMPT])[0]
    p1 = probs([PROMPT + [a] for a in range(V)])  # [a, b]
    p2 = probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)  # [a, b, c]
    joint01 = p0[:, None] * p1
    return joint01.sum(0), (joint01[:, :, None] * p2).sum((0, 1))


def chi_square_p(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells expecting fewer than 5 are pooled into one."""
    n = float(counts.sum())
    expected = expected_p * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def speculative_marginal_p_values(model) -> tuple[float, float]:
    llm = LLM(model, max_num_seqs=256, kv_blocks=512, block_size=4)
    try:
        params = [
            SamplingParams(max_tokens=4, temperature=TEMP, seed=s, ignore_eos=True, speculative_tokens=3)
            for s in range(SAMPLES)
        ]
        outs = llm.generate([PROMPT] * SAMPLES, params)
        counters = llm.work_counters()
    finally:
        llm.close()
    assert counters["spec_draft_tokens"] > SAMPLES  # out[1] and out[2] came from drafts/corrections, not plain steps
    m1, m2 = target_marginals(model)
    c1 = torch.bincount(torch.tensor([o.output_token_ids[1] for o in outs]), minlength=V)
    c2 = torch.bincount(torch.tensor([o.output_token_ids[2] for o in outs]), minlength=V)
    return chi_square_p(c1, m1), chi_square_p(c2, m2)


def test_emitted_tokens_are_distributed_as_target_sampling(small_vocab_model):
    p1, p2 = speculative_marginal_p_values(small_vocab_model)
    assert p1 > 1e-3 and p2 > 1e-3, (p1, p2)


def test_a_wrong_acceptance_rule_is_caught(small_vocab_model, monkeypatch):
    """Accepting every draft emits the draft's distribution: the same test must reject it."""
    monkeypatch.setattr(speculative, "accept_draft", lambda *args: True)
    p1, p2 = speculative_marginal_p_values(small_vocab_model)
    assert p1 < 1e-6 and p2 < 1e-6, (p1, p2)


def spec_params(n: int, **kw) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=10 + i % 5,
            temperature=0.7 + 0.1 * (i % 4),
            seed=50 + i,
            logprobs=0,
            ignore_eos=True,
            speculative_tokens=1 + i % 4,
            **kw,
        )
        for i in range(n)
    ]


def generate(model, params, *, n_prompts=None, max_num_seqs=4, kv_blocks=128, **options):
    llm = LLM(model, max_num_seqs=max_num_seqs, kv_blocks=kv_blocks, block_size=4, **options)
    try:
        return llm.generate(prompts(n_prompts or len(params), seed=4), params), llm.work_counters()
    finally:
        llm.close()


def test_speculative_outputs_match_the_trainer_replay(model):
    params = spec_params(6)
    outs, counters = generate(model, params)
    for out, p in zip(outs, params, strict=True):
        assert out.exit_depths == [T] * len(out.output_token_ids)
        assert max_replay_error(model, [out], p.temperature) <= 1e-5
    assert 0 < counters["spec_accepted_tokens"] < counters["spec_draft_tokens"]


def test_speculation_with_an_fp8_cache_matches_the_replay():
    """Drafts write their shallow K/V into the fp8 cache and verification overwrites them: the
    logprobs equal the replay's, which rounds its K/V as the cache does, and every plane holds
    the rounded K/V of a dense full-depth forward, bit for bit (fp32; exact mode, where the
    two sides' K/V have the same bits before rounding, docs/exact.md)."""
    from ouro_cli.settings import ExecutionSettings

    from .conftest import tiny_model

    model = tiny_model(0)
    params = spec_params(4)
    outs, counters = generate(model, params, execution=ExecutionSettings(exact=True, kv_cache_dtype="fp8"))
    assert model.execution.fp8_kv and 0 < counters["spec_accepted_tokens"] < counters["spec_draft_tokens"]
    for out, p in zip(outs, params, strict=True):
        assert max_replay_error(model, [out], p.temperature) <= 1e-5
    llm = LLM(model, max_num_seqs=1, kv_blocks=16, block_size=4)  # one sequence: slots 0, 1, 2, ... in order
    try:
        (out,) = llm.generate(
            prompts(1, seed=9), SamplingParams(max_tokens=16, seed=3, ignore_eos=True, speculative_tokens=3)
        )
        tokens = out.prompt_token_ids + out.output_token_ids[:-1]
        ref: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            model(torch.tensor([tokens]), kv_sink=lambda t, i, k, v: ref.__setitem__((t, i), (k[0], v[0])))
        assert llm.kv.fp8 and llm.work_counters()["spec_accepted_tokens"] > 0
        for (loop, layer), (k, v) in ref.items():
            assert torch.equal(
                torch.stack(llm.kv.read(layer, loop - 1, torch.arange(len(tokens)))), torch.stack([k, v])
            )
    finally:
        llm.close()


def test_the_cache_holds_full_depth_kv_after_speculation(model):
    """Drafted positions first hold depth-2 K/V (planes 3..T copies of plane 2); once verified,
    every plane must hold what a dense full-depth forward of the same tokens produces."""
    llm = LLM(model, max_num_seqs=1, kv_blocks=16, block_size=4)  # one sequence: slots 0, 1, 2, ... in order
    try:
        (out,) = llm.generate(
            prompts(1, seed=9), SamplingParams(max_tokens=16, seed=3, ignore_eos=True, speculative_tokens=3)
        )
        tokens = out.prompt_token_ids + out.output_token_ids[:-1]  # what the cache holds when it finishes
        ref: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            model(torch.tensor([tokens]), kv_sink=lambda t, i, k, v: ref.__setitem__((t, i), (k[0], v[0])))
        n, c = len(tokens), llm.work_counters()
        assert 0 < c["spec_accepted_tokens"] < c["spec_draft_tokens"]
        for (loop, layer), (k, v) in ref.items():
            assert float((llm.kv.k[layer, loop - 1, :, :n].transpose(0, 1) - k).abs().max()) <= 1e-5, (loop, layer)
            assert float((llm.kv.v[layer, loop - 1, :, :n].transpose(0, 1) - v).abs().max()) <= 1e-5, (loop, layer)
    finally:
        llm.close()


def test_draft_loops_and_raw_logprobs(model):
    params = [
        SamplingParams(
            max_tokens=12, temperature=1.0, seed=s, logprobs=0, ignore_eos=True, speculative_tokens=3, draft_loops=d
        )
        for s, d in enumerate((1, 3))
    ]
    outs, _ = generate(model, params)
    assert max_replay_error(model, outs, 1.0) <= 1e-5
    raw = [dataclasses.replace(p, logprobs_mode="raw", temperature=0.7) for p in params]
    outs, _ = generate(model, raw)
    assert max_replay_error(model, outs, 1.0) <= 1e-5  # raw = log_softmax(logits / 1)


def test_scheduling_does_not_change_speculative_outputs(model):
    params = spec_params(7)
    one, _ = generate(model, params, max_num_seqs=1)
    four, counters = generate(model, params, max_num_seqs=4)
    again, _ = generate(model, params, max_num_seqs=4)
    assert_same(one, four)
    assert_same(four, again, logprob_tol=0.0)
    assert counters["preemptions"] == 0
    tight, counters = generate(model, params, kv_blocks=9)
    assert counters["preemptions"] > 0
    assert_same(four, tight, logprob_tol=1e-5)


def test_every_row_is_counted(model):
    params = spec_params(5)
    outs, c = generate(model, params)
    layers = model.config.num_hidden_layers
    steps = c["spec_verify_rows"] - c["spec_draft_tokens"]  # one verification row per draft, plus one per step
    emitted = sum(len(o.output_token_ids) - 1 for o in outs)
    assert emitted == c["spec_accepted_tokens"] + steps  # each step emits its accepted drafts and one more token
    assert c["decode_layer_tokens"] == (c["spec_draft_tokens"] * 2 + c["spec_verify_rows"] * T) * layers
    assert c["decode_tokens"] == c["spec_draft_tokens"] + c["spec_verify_rows"]


def test_greedy_speculation_is_greedy_target_decoding(model):
    spec = [
        SamplingParams(max_tokens=12, temperature=0.0, seed=s, logprobs=0, ignore_eos=True, speculative_tokens=3)
        for s in range(4)
    ]
    plain = [SamplingParams(max_tokens=12, temperature=0.0, seed=s, logprobs=0, ignore_eos=True) for s in range(4)]
    a, _ = generate(model, spec)
    b, _ = generate(model, plain)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert all(lp == 0.0 for o in a for lp in o.log_probs)


def test_a_stop_token_ends_the_step(model):
    plain, _ = generate(model, spec_params(6))
    stop = max(range(96), key=lambda t: sum(o.output_token_ids[1:].count(t) for o in plain))  # a frequent token
    params = [dataclasses.replace(p, stop_token_ids=(stop,)) for p in spec_params(6)]
    outs, _ = generate(model, params)
    assert any(o.finish_reason == "stop" for o in outs)
    for out, p in zip(outs, params, strict=True):
        ids = out.output_token_ids
        assert stop not in ids[:-1] and (out.finish_reason == "stop") == (ids[-1] == stop)
        assert len(ids) <= p.max_tokens
        assert max_replay_error(model, [out], p.temperature) <= 1e-5


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(exit_threshold=0.5), "exit_threshold=1"),
        (dict(exit_mode="delayed"), "exit_mode='immediate'"),
        (dict(speculative_tokens=-1), "speculative_tokens must be >= 0"),
        (dict(draft_loops=0), "draft_loops >= 1"),
    ],
)
def test_incompatible_params_fail_clearly(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{"speculative_tokens": 3, **bad})


def test_speculation_needs_full_depth_and_synchronous_scheduling(model):
    llm = LLM(model, max_num_seqs=2, kv_blocks=32, block_size=4)
    try:
        with pytest.raises(RequestRejected, match="max_loops = T"):
            llm.generate([[1, 2, 3]], SamplingParams(speculative_tokens=2, max_loops=3))
        with pytest.raises(RequestRejected, match="draft_loops"):
            llm.generate([[1, 2, 3]], SamplingParams(speculative_tokens=2, draft_loops=T + 1))
    finally:
        llm.close()
    llm = LLM(model, max_num_seqs=2, kv_blocks=32, block_size=4, async_scheduling=True)
    try:
        with pytest.raises(RequestRejected, match="synchronous scheduling"):
            llm.generate([[1, 2, 3]], SamplingParams(speculative_tokens=2))
    finally:
        llm.close()


@pytest.mark.gpu
def test_cuda_speculation_with_graphs_matches_replay():
    from .conftest import tiny_model

    model = tiny_model(0).cuda()
    params = spec_params(5)
    eager, _ = generate(model, params, cuda_graphs=False)
    graphed, _ = generate(model, params, cuda_graphs=True)
    assert_same(eager, graphed, logprob_tol=1e-6)
    for out, p in zip(graphed, params, strict=True):
        assert max_replay_error(model, [out], p.temperature) <= 1e-5
