"""The same guarantees on CUDA (skipped without a GPU): fp32 logprobs equal the replay,
captured CUDA graphs give the eager results (a captured prefill the eager one's bits, a
prompt the same bits alone or in a prefill group), batch size does not change outputs,
published weights reach captured graphs, and a bf16 engine runs."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams
from ouro_cli.engine import runner as runner_module
from ouro_cli.engine.runner import PrefillItem

from .conftest import prompts, tiny_model
from .test_replay import max_replay_error

pytestmark = pytest.mark.gpu

PARAMS = [
    SamplingParams(max_tokens=12, seed=s, logprobs=0, exit_threshold=0.5, exit_mode=m, ignore_eos=True)
    for s, m in enumerate(["immediate", "delayed", "immediate", "delayed", "immediate"])
]


def _generate(model, n, graphs, params=PARAMS):
    llm = LLM(model, max_num_seqs=n, kv_blocks=64, block_size=4, cuda_graphs=graphs)
    try:
        return llm.generate(prompts(5, seed=1), params)
    finally:
        llm.close()


def _assert_same(a_outs, b_outs, tol=1e-6):
    for a, b in zip(a_outs, b_outs, strict=True):
        assert a.output_token_ids == b.output_token_ids and a.exit_depths == b.exit_depths
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) <= tol


def test_cuda_fp32_matches_replay_graphs_and_batch_sizes():
    model = tiny_model(0).cuda()
    eager = _generate(model, 4, graphs=False)
    assert len({d for o in eager for d in o.exit_depths[1:]}) >= 3
    assert max_replay_error(model, eager, 1.0) <= 1e-5
    for n in (1, 4):
        graphed = _generate(model, n, graphs=True)
        _assert_same(graphed, eager)
        assert max_replay_error(model, graphed, 1.0) <= 1e-5


def test_cuda_graphs_see_published_weights():
    model = tiny_model(0).cuda()
    llm = LLM(model, max_num_seqs=4, kv_blocks=64, block_size=4, cuda_graphs=True)
    llm.generate(prompts(5, seed=1), PARAMS)  # captures graphs on the old weights
    new = tiny_model(1).cuda()
    llm.start_weight_update(1)
    llm.update_weights([(n, p.detach()) for n, p in new.named_parameters()])
    llm.finish_weight_update()
    after = llm.generate(prompts(5, seed=1), PARAMS)
    _assert_same(after, _generate(new, 4, graphs=False))
    counters = llm.work_counters()
    assert counters["decode_steps_graphed"] == counters["decode_steps"] > 0 and counters["decode_steps_eager"] == 0
    assert counters["prefill_steps_graphed"] == 10  # 5 prompts, twice


def test_cuda_prefill_graph_gives_the_eager_bits():
    """A fresh prompt's captured prefill (its bucket width) against the same prefill run eagerly:
    the same logits and the same K/V in every layer and plane, to the bit."""
    model = tiny_model(0).cuda()
    llm = LLM(model, max_num_seqs=4, kv_blocks=64, block_size=4, cuda_graphs=True)
    runner, kv = llm.core.runner, llm.core.kv
    tokens = prompts(1, seed=3, lo=11, hi=11)[0]
    item = PrefillItem(tokens, [model.num_loops] * len(tokens), list(range(8, 8 + len(tokens))))
    try:
        llm.core.restore_memory()  # the cache, if the engine holds none yet
        graphed = runner.prefill(item)
        cached = kv.k[..., 8 : 8 + len(tokens), :].clone(), kv.v[..., 8 : 8 + len(tokens), :].clone()
        kv.k.zero_(), kv.v.zero_()
        graphs, runner.graphs = runner.graphs, None  # graphs off: the eager prefill at the same width
        eager = runner.prefill(item)
        runner.graphs = graphs
        assert torch.equal(graphed, eager)
        assert torch.equal(cached[0], kv.k[..., 8 : 8 + len(tokens), :]) and torch.equal(
            cached[1], kv.v[..., 8 : 8 + len(tokens), :]
        )
        assert llm.work_counters()["prefill_steps_graphed"] == 1
    finally:
        llm.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_prefill_groups_give_a_prompt_its_bits_alone(monkeypatch, dtype):
    """Fresh prompts prefilled together (one captured group) and one at a time (the PD prefill
    worker's way), graphs on and off: the same logits and K/V in every layer and plane (fp32
    grouped here too, as with a larger MAX_PREFILL_GROUP_FP32)."""
    monkeypatch.setattr(runner_module, "MAX_PREFILL_GROUP_FP32", runner_module.MAX_PREFILL_GROUP)
    model = tiny_model(0).to("cuda", dtype)
    t = model.num_loops
    items = [
        PrefillItem(p, [t] * len(p), list(range(16 * i, 16 * i + len(p)))) for i, p in enumerate(prompts(6, seed=2))
    ]
    used = 16 * len(items)
    results = []
    for graphs in (True, False):
        llm = LLM(model, max_num_seqs=8, kv_blocks=64, block_size=4, cuda_graphs=graphs)
        runner, kv = llm.core.runner, llm.core.kv
        try:
            llm.core.restore_memory()
            for together in (True, False):
                kv.k.zero_(), kv.v.zero_()
                logits = runner.prefill_many(items) if together else [runner.prefill(item) for item in items]
                results.append((torch.stack(logits), kv.k[..., :used, :].clone(), kv.v[..., :used, :].clone()))
        finally:
            llm.close()
    first = results[0]
    assert first[1].abs().sum() > 0
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_cuda_bf16_runs():
    model = tiny_model(0)
    llm = LLM(model, device="cuda", dtype=torch.bfloat16, max_num_seqs=4, kv_blocks=64, block_size=4)
    outs = llm.generate(prompts(4, seed=1), SamplingParams(max_tokens=10, seed=0, logprobs=0, max_loops=3))
    assert all(o.exit_depths[0] == 4 and all(d == 3 for d in o.exit_depths[1:]) for o in outs)
    assert all(lp <= 0.0 for o in outs for lp in o.log_probs)
