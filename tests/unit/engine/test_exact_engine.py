"""Exact mode end to end in the engine (docs/exact.md): every logprob the engine reports is
bit for bit the trainer's replay, in bf16 as in fp32, with threshold exits at mixed depths,
with an fp8 KV cache as with the model's dtype, and a request's tokens, depths and logprobs do
not depend on what it is batched with. In the default mode bf16 does not agree to the bit
(the negative control: the test can see a difference). The replay here is what the trainer
computes (tests/integration runs the trainer itself: `ouro train --exact`)."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams
from ouro_cli.errors import SettingError
from ouro_cli.model import pointwise
from ouro_cli.settings import ExecutionSettings, executing

from .conftest import prompts, tiny_model

EXACT = ExecutionSettings(exact=True)
T = 4


def _generate(model, execution, max_num_seqs=4, n=6):
    llm = LLM(model, max_num_seqs=max_num_seqs, kv_blocks=64, block_size=4, execution=execution)
    params = [
        SamplingParams(max_tokens=14, temperature=1.0, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True)
        for s in range(n)
    ]
    try:
        return llm.generate(prompts(n, seed=1), params)
    finally:
        llm.close()


def _replay(model, out) -> torch.Tensor:
    m, r = len(out.prompt_token_ids), out.output_token_ids
    ids = torch.tensor([out.prompt_token_ids + r])
    depths = torch.tensor([[T] * m + out.exit_depths[1:] + [T]])
    with torch.no_grad(), executing(model.execution):
        logp = pointwise.log_softmax(model(ids, depths=depths)[0].float())
    return logp[m - 1 : m - 1 + len(r)].gather(1, torch.tensor(r)[:, None]).squeeze(1)


def _max_mismatch(model, outs) -> float:
    return max(float((torch.tensor(o.log_probs) - _replay(model, o)).abs().max()) for o in outs)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_engine_logprobs_are_the_replay_to_the_bit(dtype, kv_cache_dtype):
    model = tiny_model(0).to(dtype)
    execution = ExecutionSettings(exact=True, kv_cache_dtype=kv_cache_dtype)
    outs = _generate(model, execution)
    assert len({d for o in outs for d in o.exit_depths[1:]}) >= 3, "the gate should give mixed depths"
    assert _max_mismatch(model, outs) == 0.0
    alone = _generate(model, execution, max_num_seqs=1)  # each request decoded by itself
    for a, b in zip(outs, alone, strict=True):
        assert (a.output_token_ids, a.exit_depths, a.log_probs) == (b.output_token_ids, b.exit_depths, b.log_probs)


def test_default_mode_in_bf16_is_not_exact():
    model = tiny_model(0).to(torch.bfloat16)
    outs = _generate(model, ExecutionSettings())
    assert _max_mismatch(model, outs) > 1e-3


def test_exact_chooses_its_kernels_and_is_recorded():
    assert EXACT.effective("cpu") == {
        "compile": "off",
        "compile_layers": "off",
        "decode_attention": "exact",
        "decode_gemv": "exact",
        "replay_attention": "exact",
        "exact": "on",
        "kv_cache_dtype": "model",
    }
    assert not ExecutionSettings(exact=True, compile="auto").compiles("cuda")
    assert ExecutionSettings().effective("cpu")["exact"] == "off"
    for kwargs, named in (
        (dict(decode_gemv="triton"), "--decode-gemv"),
        (dict(replay_attention="paged"), "--replay-attention"),
        (dict(compile="always"), "--compile always"),
    ):
        with pytest.raises(SettingError, match=f"--exact chooses its kernels itself .*drop {named}"):
            ExecutionSettings(exact=True, **kwargs)
    ExecutionSettings(exact=True, compile="off", compile_layers="off").check("cpu")


def test_pd_workers_compute_in_exact_mode_too():
    """The prefill and decode workers are given the coordinator model's settings: in bf16 their
    outputs are the local exact engine's bit for bit (which the default-mode workers' are not
    held to), so the replay agrees with them to the bit as well."""
    from ouro_cli.engine.pd import make_pd_engine

    model = tiny_model(0).to(torch.bfloat16)
    params = [SamplingParams(max_tokens=8, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True) for s in range(3)]
    batch = prompts(3, seed=2)
    pd = make_pd_engine(
        tiny_model(0).to(torch.bfloat16),
        [0],
        [1],
        timeout=60,
        device="cpu",
        max_num_seqs=1,
        kv_blocks=64,
        block_size=4,
        transport="shm",
        execution=EXACT,
    )
    try:
        got = pd.generate(batch, params)
    finally:
        pd.close()
    local = LLM(model, max_num_seqs=1, kv_blocks=64, block_size=4, execution=EXACT)
    try:
        expected = local.generate(batch, params)
    finally:
        local.close()
    for a, b in zip(got, expected, strict=True):
        assert (a.output_token_ids, a.exit_depths, a.log_probs) == (b.output_token_ids, b.exit_depths, b.log_probs)
    assert _max_mismatch(model, got) == 0.0


def test_exact_true_is_the_exact_settings_in_the_engine_and_the_trainer():
    """`LLM(model, exact=True)` and `Trainer(model, exact=True)`: the Python spelling of
    `--exact`; it turns exact mode on in whatever settings the model carries."""
    pytest.importorskip("megatron.core")
    from ouro_cli.trainer import Trainer, TrainerConfig

    model = tiny_model(0).to(torch.bfloat16)
    llm = LLM(model, max_num_seqs=4, kv_blocks=64, block_size=4, exact=True)
    try:
        assert llm.model.execution == EXACT
        params = [
            SamplingParams(max_tokens=14, temperature=1.0, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True)
            for s in range(6)
        ]
        outs = llm.generate(prompts(6, seed=1), params)
    finally:
        llm.close()
    for a, b in zip(outs, _generate(model, EXACT), strict=True):
        assert (a.output_token_ids, a.exit_depths, a.log_probs) == (b.output_token_ids, b.exit_depths, b.log_probs)
    with Trainer(tiny_model(0), TrainerConfig(device="cpu", params_dtype="fp32"), exact=True) as trainer:
        assert trainer.execution.exact and trainer.module.ouro.execution.exact
