"""The heart of the project: every logprob the engine reports equals the trainer's replay.

For each generated token, the processed logprob equals
`log_softmax(model(prompt + response, depths=[T]*m + exit_depths[1:] + [T]) / temperature)`
at the scoring position (docs/model.md §3), to 1e-5 in fp32, for fixed budgets K = 1..T,
threshold exits with mixed depths, the delayed variant, traces, and batches of
requests of different lengths. A mutated cache (planes past a token's exit left
unfilled) must make the comparison fail, which shows the test can catch a wrong plane.

With an fp8 KV cache the replay rounds its K/V as the cache stores them (model/kv_quant.py),
and the same bound holds wherever the two sides compute K/V to the same bits before rounding:
in exact mode (`kv_model`'s "fp8-exact"). In the default mode their fp32 K/V differ in the last
bits (other attention orders), and an element that lies on a rounding boundary of fp8 then
rounds to neighbouring values on the two sides: most tokens still agree to 1e-5, the tokens
after such an element by about 1e-3 (`test_an_fp8_cache_in_the_default_mode...`). A replay
that does not round its K/V misses every token.
"""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import SamplingParams
from ouro_cli.engine.kv_cache import PagedKVCache
from ouro_cli.settings import ExecutionSettings

from .conftest import prompts, tiny_model

TOL = 1e-5
T = 4


def replay_logprobs(model, out, temperature: float) -> torch.Tensor:
    m, r = len(out.prompt_token_ids), out.output_token_ids
    device = next(model.parameters()).device
    ids = torch.tensor([out.prompt_token_ids + r], device=device)
    depths = torch.tensor([[model.num_loops] * m + out.exit_depths[1:] + [model.num_loops]], device=device)
    with torch.no_grad():
        logits = model(ids, depths=depths)[0]
    lp = torch.log_softmax(logits.float() / temperature, dim=-1).cpu()
    return lp[m - 1 : m - 1 + len(r)].gather(1, torch.tensor(r)[:, None]).squeeze(1)


def max_replay_error(model, outs, temperature: float) -> float:
    err = 0.0
    for out in outs:
        assert out.exit_depths[0] == model.num_loops
        assert len(out.exit_depths) == len(out.output_token_ids) == len(out.log_probs)
        ref = replay_logprobs(model, out, temperature)
        err = max(err, float((torch.tensor(out.log_probs) - ref).abs().max()))
    return err


KV_SETTINGS = {"auto": ExecutionSettings(), "fp8-exact": ExecutionSettings(kv_cache_dtype="fp8", exact=True)}


@pytest.fixture(params=list(KV_SETTINGS))
def kv_model(request):
    """The tiny model computing with the model's dtype in its KV cache (default mode), or with an
    fp8 cache in exact mode: its settings are the engine's (LLM keeps a model's settings) and the
    replay's."""
    model = tiny_model(0)
    model.execution = KV_SETTINGS[request.param]
    return model


def run(make_engine, model, params, n=5, max_num_seqs=4, **options):
    llm = make_engine(model, max_num_seqs=max_num_seqs, kv_blocks=64, block_size=4, **options)
    try:
        return llm.generate(prompts(n, seed=1), params)
    finally:
        llm.close()


@pytest.mark.parametrize("k", range(1, T + 1))
def test_fixed_budget_matches_replay(make_engine, kv_model, k):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, logprobs=0, max_loops=k, ignore_eos=True)
    outs = run(make_engine, kv_model, params)
    assert all(d == k for o in outs for d in o.exit_depths[1:])
    assert max_replay_error(kv_model, outs, 0.8) <= TOL


@pytest.mark.parametrize("mode,min_loops", [("immediate", 1), ("immediate", 2), ("delayed", 1)])
def test_threshold_exits_match_replay(make_engine, kv_model, mode, min_loops):
    model = kv_model
    params = [
        SamplingParams(
            max_tokens=14,
            temperature=1.0,
            seed=s,
            logprobs=0,
            exit_threshold=0.5,
            exit_mode=mode,
            min_loops=min_loops,
            ignore_eos=True,
        )
        for s in range(6)
    ]
    outs = run(make_engine, model, params, n=6)
    depths = {d for o in outs for d in o.exit_depths[1:]}
    assert len(depths) >= 3, f"the gate should produce mixed exits, got depths {depths}"
    assert min(depths) >= min_loops + (mode == "delayed")
    assert max_replay_error(model, outs, 1.0) <= TOL
    # The depths matter: replaying every token at full depth gives different logprobs.
    full = [o.__class__(**{**o.__dict__, "exit_depths": [T] * len(o.exit_depths)}) for o in outs]
    assert max_replay_error(model, full, 1.0) > 1e-3


def test_trace_policy_replays_given_depths(make_engine, model):
    trace = (3, 1, 4, 2, 2, 1, 3, 4, 1)
    params = SamplingParams(
        max_tokens=12, seed=3, logprobs=0, exit_mode="trace", exit_trace=trace, max_loops=3, ignore_eos=True
    )
    outs = run(make_engine, model, params, n=3)
    for out in outs:
        assert tuple(out.exit_depths[1:10]) == trace
        assert out.exit_depths[10:] == [3, 3]
    assert max_replay_error(model, outs, 1.0) <= TOL


def test_mixed_policies_in_one_batch(make_engine, kv_model):
    model = kv_model
    kinds = [
        dict(max_loops=2),
        dict(exit_threshold=0.5),
        dict(exit_threshold=0.4, exit_mode="delayed"),
        dict(max_loops=1),
        dict(exit_threshold=0.6, min_loops=2, max_loops=3),
    ]
    params = [
        SamplingParams(max_tokens=10 + i, temperature=0.7 + 0.1 * i, seed=i, logprobs=0, ignore_eos=True, **kw)
        for i, kw in enumerate(kinds)
    ]
    outs = run(make_engine, model, params, n=len(params))
    for out, p in zip(outs, params, strict=True):
        assert max_replay_error(model, [out], p.temperature) <= TOL


def test_exit_depths_follow_the_gate(make_engine, model):
    """Each depth is the first loop t >= min_loops whose exit CDF reaches τ (delayed: t + 1),
    with the CDF computed from the replayed hidden states of that token."""
    tau = 0.5
    for mode in ("immediate", "delayed"):
        params = SamplingParams(max_tokens=10, seed=11, logprobs=0, exit_threshold=tau, exit_mode=mode, ignore_eos=True)
        (out,) = run(make_engine, model, params, n=1)
        m, r = len(out.prompt_token_ids), out.output_token_ids
        for j in range(1, len(r)):
            states: list[torch.Tensor] = []
            ids = torch.tensor([out.prompt_token_ids + r[:j]])
            depths = torch.tensor([[T] * m + out.exit_depths[1:j] + [T]])
            with torch.no_grad():
                model(ids, depths=depths, state_sink=lambda t, h, states=states: states.append(h[0, -1]))
            with torch.no_grad():
                lam = torch.stack([model.exit_lambda(h) for h in states])  # [T]
            survive, cdf, expected = 1.0, 0.0, T
            for t in range(1, T):
                cdf, survive = cdf + float(lam[t - 1]) * survive, survive * (1 - float(lam[t - 1]))
                if cdf >= tau:
                    expected = t if mode == "immediate" else min(t + 1, T)
                    break
            assert out.exit_depths[j] == expected, (mode, j)


def test_replay_catches_a_wrong_kv_plane(make_engine, model, monkeypatch):
    """Leave the planes past each token's exit unfilled: deeper queries then read stale
    K/V and the replay comparison must fail."""
    params = SamplingParams(max_tokens=14, seed=5, logprobs=0, exit_threshold=0.5, ignore_eos=True)
    monkeypatch.setattr(PagedKVCache, "copy_forward", lambda self, slots, last_plane: None)
    outs = run(make_engine, model, params, n=1, max_num_seqs=1)
    assert max_replay_error(model, outs, 1.0) > 1e-3


@pytest.mark.parametrize("seed", range(3))
def test_an_fp8_cache_in_the_default_mode_agrees_but_where_an_element_rounds_apart(make_engine, seed):
    """Default mode, fp8 cache, threshold exits: the median token agrees with the replay to TOL
    (most tokens do; those after an element that the two sides' last-bit differences rounded to
    neighbouring fp8 values differ by about 1e-3), while a replay that does not round its K/V
    misses the median token by more than 1e-3."""
    params = [
        SamplingParams(max_tokens=14, temperature=1.0, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True)
        for s in range(6)
    ]
    model = tiny_model(seed)
    model.execution = ExecutionSettings(kv_cache_dtype="fp8")
    llm = make_engine(model, max_num_seqs=4, kv_blocks=64, block_size=4)
    try:
        outs = llm.generate(prompts(6, seed=seed), params)
    finally:
        llm.close()

    def errors() -> torch.Tensor:
        return torch.cat([(torch.tensor(o.log_probs) - replay_logprobs(model, o, 1.0)).abs() for o in outs])

    rounded = errors()
    model.execution = ExecutionSettings()
    unrounded = errors()
    print(
        f"seed {seed}: fp8 replay within {TOL}: {float((rounded <= TOL).float().mean()):.3f}, max {rounded.max():.2g}"
    )
    assert rounded.median() <= TOL and unrounded.median() > 1e-3


def test_gqa_free_model_matches_replay(make_engine):
    model = tiny_model(3, num_key_value_heads=4, total_ut_steps=3)
    params = SamplingParams(max_tokens=9, seed=2, logprobs=0, exit_threshold=0.5, ignore_eos=True)
    outs = run(make_engine, model, params, n=3)
    assert all(o.exit_depths[0] == 3 for o in outs)
    assert max_replay_error(model, outs, 1.0) <= TOL
