"""The engine contract beyond depths: the Protocol and factory loader, request
validation, stop conditions, sampling transforms and their logprobs, text prompts,
pausing and aborting, work counters and close."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ouro_cli.engine import (
    DEFAULT_FACTORY,
    LLM,
    EngineBusy,
    EngineError,
    RequestRejected,
    RolloutEngine,
    SamplingParams,
    load_factory,
)
from ouro_cli.engine import (
    make_engine as make_engine_from_path,
)
from ouro_cli.errors import UserError

from .conftest import prompts, tiny_model


def test_engines_satisfy_the_protocol(make_engine, model):
    engine = make_engine(model, max_num_seqs=2, kv_blocks=16, block_size=4)
    assert isinstance(engine, RolloutEngine)
    engine.close()
    with pytest.raises(EngineError):
        engine.generate([[1, 2]], SamplingParams(max_tokens=2))


def test_factory_loader(model):
    assert load_factory(DEFAULT_FACTORY) is load_factory("ouro_cli.engine.factory.default_factory")
    engine = make_engine_from_path(DEFAULT_FACTORY, model, max_num_seqs=1, kv_blocks=8, block_size=4)
    assert isinstance(engine, LLM)
    for bad in (
        "nodots",
        "ouro_cli.engine.factory:missing",
        "no_such_module_xyz:f",
        "ouro_cli.engine.factory:DEFAULT_FACTORY",
    ):
        with pytest.raises(UserError):
            make_engine_from_path(bad, model)
    with pytest.raises(UserError, match="contract"):
        make_engine_from_path(f"{__name__}:not_an_engine", model)


def not_an_engine(model, **options):
    return object()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=0),
        dict(logprobs=5),
        dict(logprobs_mode="scaled"),
        dict(exit_mode="later"),
        dict(exit_mode="trace"),
        dict(exit_threshold=0),
        dict(min_loops=0),
        dict(min_loops=3, max_loops=2),
        dict(seed=-1),
    ],
)
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_checked_against_the_model(make_engine, model):
    engine = make_engine(model, max_num_seqs=2, kv_blocks=16, block_size=4)
    for params in (
        SamplingParams(max_loops=5),
        SamplingParams(min_loops=4, max_loops=None, exit_trace=(9,), exit_mode="trace"),
    ):
        with pytest.raises(ValueError):
            engine.generate([[1, 2]], params)
    with pytest.raises(ValueError):
        engine.generate([[1, 2], [3]], [SamplingParams()])  # one params per prompt
    with pytest.raises(ValueError):
        engine.generate([[1, 999]], SamplingParams())
    with pytest.raises(ValueError):
        engine.generate([[]], SamplingParams())
    (out,) = engine.generate([[1, 2]], SamplingParams(max_tokens=3, seed=4))
    assert out.sampling_params.max_loops == 4 and out.sampling_params.seed == 4
    engine.close()


def test_stop_tokens_eos_and_lengths(make_engine):
    model = tiny_model(0)
    engine = make_engine(model, max_num_seqs=4, kv_blocks=64, block_size=4)
    base = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (free,) = engine.generate([[5, 6, 7]], base)
    assert free.finish_reason == "length" and len(free.output_token_ids) == 12
    stop = free.output_token_ids[4]
    first = free.output_token_ids.index(stop)
    (stopped,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == free.output_token_ids[: first + 1]  # the stop token is kept
    assert len(stopped.exit_depths) == first + 1
    (one,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1))
    assert one.finish_reason in ("length", "stop") and one.exit_depths == [4]
    # eos (config eos_token_id = 0) stops unless ignore_eos
    with torch.no_grad():
        model.lm_head.weight[0] += 5.0 * model.lm_head.weight[free.output_token_ids[0]]  # make 0 likely
    (eos,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.0))
    assert eos.finish_reason == "stop" and eos.output_token_ids[-1] == 0
    (ignored,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert ignored.finish_reason == "length"
    engine.close()


def _reference_logits(model, out):
    T, m, r = model.num_loops, len(out.prompt_token_ids), out.output_token_ids
    ids = torch.tensor([out.prompt_token_ids + r])
    depths = torch.tensor([[T] * m + out.exit_depths[1:] + [T]])
    with torch.no_grad():
        return model(ids, depths=depths)[0, m - 1 : m - 1 + len(r)].double()


def test_processed_and_raw_logprobs_with_top_k_top_p(make_engine, model):
    """processed = temperature, top-k, top-p, renormalise; raw = unscaled log_softmax.
    Checked against an fp64 recomputation written here from the replayed logits."""
    engine = make_engine(model, max_num_seqs=4, kv_blocks=64, block_size=4)
    common = dict(max_tokens=10, logprobs=0, exit_threshold=0.5, ignore_eos=True, temperature=0.7, top_k=8, top_p=0.8)
    proc, raw = engine.generate(
        [prompts(1)[0]] * 2, [SamplingParams(seed=3, **common), SamplingParams(seed=3, logprobs_mode="raw", **common)]
    )
    assert proc.output_token_ids == raw.output_token_ids and proc.exit_depths == raw.exit_depths
    logits = _reference_logits(model, proc)
    for j, tok in enumerate(proc.output_token_ids):
        x = logits[j] / 0.7
        order = torch.argsort(x, descending=True)
        keep = order[:8]
        probs = torch.softmax(x[keep], 0)
        cum_before = torch.cumsum(probs, 0) - probs
        keep = keep[cum_before < 0.8]
        assert tok in keep.tolist(), "sampled outside the top-k/top-p set"
        ref = torch.log_softmax(x[keep], 0)[keep.tolist().index(tok)]
        assert abs(proc.log_probs[j] - float(ref)) <= 1e-5
        assert abs(raw.log_probs[j] - float(torch.log_softmax(logits[j], 0)[tok])) <= 1e-5
    engine.close()


def test_greedy(make_engine, model):
    engine = make_engine(model, max_num_seqs=2, kv_blocks=64, block_size=4)
    (out,) = engine.generate(
        [[9, 8, 7, 6]], SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, max_loops=2, ignore_eos=True)
    )
    logits = _reference_logits(model, out)
    assert out.output_token_ids == logits.argmax(-1).tolist()
    assert out.log_probs == [0.0] * 8  # the sampled distribution is a point mass
    engine.close()


def test_text_prompts_with_a_tokenizer(model):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(96)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    engine = LLM(model, max_num_seqs=2, kv_blocks=32, block_size=4, tokenizer=tok)
    (out,) = engine.generate(["w5 w6 w7"], SamplingParams(max_tokens=4, seed=0))
    assert out.prompt_token_ids == [5, 6, 7] and out.prompt == "w5 w6 w7"
    assert out.text == tok.decode(out.output_token_ids)
    with pytest.raises(RequestRejected, match="tokenizer"):
        LLM(model, max_num_seqs=1, kv_blocks=8, block_size=4).generate(["w1"], SamplingParams())


def test_checkpoint_path_with_tokenizer_json(tmp_path, model):
    checkpoint = pytest.importorskip("ouro_cli.checkpoint")
    if not hasattr(checkpoint, "read_checkpoint"):
        pytest.skip("ouro_cli.checkpoint.read_checkpoint is not available yet")
    from safetensors.torch import save_file

    tokenizers = pytest.importorskip("tokenizers")

    model.config.save(tmp_path)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, tmp_path / "model.safetensors")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    engine = LLM(str(tmp_path), dtype=torch.float32, max_num_seqs=1, kv_blocks=16, block_size=4)
    (a,) = engine.generate(["w5 w6"], SamplingParams(max_tokens=4, seed=0, logprobs=0))
    (b,) = LLM(model, max_num_seqs=1, kv_blocks=16, block_size=4).generate(
        [[5, 6]], SamplingParams(max_tokens=4, seed=0, logprobs=0)
    )
    assert a.output_token_ids == b.output_token_ids and a.text is not None


def test_work_counters(make_engine, model):
    engine = make_engine(model, max_num_seqs=4, kv_blocks=128, block_size=4)
    ps = prompts(5, seed=4)
    outs = engine.generate(ps, SamplingParams(max_tokens=7, seed=0, exit_threshold=0.5, ignore_eos=True))
    counters = engine.work_counters()
    if not counters:
        pytest.skip("this engine reports no work counters")
    layers = model.config.num_hidden_layers
    assert counters["prefill_layer_tokens"] == layers * 4 * sum(len(p) for p in ps)
    assert counters["decode_layer_tokens"] == layers * sum(sum(o.exit_depths[1:]) for o in outs)
    assert counters["decode_layer_tokens_executed"] >= counters["decode_layer_tokens"]
    engine.close()


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["stepwise", "overlap"])


@OVERLAP
def test_pause_abort_and_idle_publication(model, overlap):
    engine = LLM(model, max_num_seqs=2, kv_blocks=64, block_size=4, overlap=overlap)
    params = SamplingParams(max_tokens=150, seed=0, ignore_eos=True)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("outs", engine.generate([[1, 2, 3], [4, 5]], params)))
    worker.start()
    while engine.work_counters()["decode_steps"] < 3:
        time.sleep(0.001)
    engine.pause_generation()
    with pytest.raises(EngineBusy):  # requests held, not idle
        engine.start_weight_update(1)
    engine.pause_generation(abort=True)  # returns once generate has returned
    worker.join(timeout=30)
    outs = result["outs"]
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert 1 <= len(outs[0].output_token_ids) < 150 and len(outs[0].exit_depths) == len(outs[0].output_token_ids)
    with pytest.raises(EngineBusy):
        engine.generate([[1]], params)
    engine.start_weight_update(1)
    engine.update_weights([(n, p.detach().clone()) for n, p in model.named_parameters()])
    engine.finish_weight_update()
    engine.resume_generation()
    (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=5, seed=0, ignore_eos=True))
    assert out.weight_version == 1 and out.finish_reason == "length"
    assert engine.kv.allocator.num_free == engine.kv.num_blocks  # aborted requests gave their blocks back


@OVERLAP
def test_pause_holds_and_resume_continues(model, overlap):
    engine = LLM(model, max_num_seqs=2, kv_blocks=64, block_size=4, overlap=overlap)
    params = SamplingParams(max_tokens=40, seed=0, ignore_eos=True)
    (expected,) = engine.generate([[1, 2, 3]], params)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("outs", engine.generate([[1, 2, 3]], params)))
    worker.start()
    while engine.work_counters()["decode_steps"] < 42:
        time.sleep(0.001)
    engine.pause_generation()
    steps = engine.work_counters()["decode_steps"]
    time.sleep(0.05)
    assert engine.work_counters()["decode_steps"] <= steps + 1  # at most the step in flight finishes
    engine.resume_generation()
    worker.join(timeout=30)
    (out,) = result["outs"]
    assert out.output_token_ids == expected.output_token_ids and out.finish_reason == "length"


def test_generate_progress_counts_each_call(model):
    """`generate_progress` (contract.ReportsProgress): per call, its requests, how many finished,
    the tokens decoded after the prefill's first and the most the requests allow."""
    from ouro_cli.engine.contract import GenerateProgress, ReportsProgress

    engine = LLM(model, max_num_seqs=2, kv_blocks=64, block_size=4)  # 5 requests finish in waves
    assert isinstance(engine, ReportsProgress) and engine.generate_progress == GenerateProgress()
    for call, max_tokens in ((1, 7), (2, 3)):
        outs = engine.generate(prompts(5, seed=4), SamplingParams(max_tokens=max_tokens, seed=0, ignore_eos=True))
        assert engine.generate_progress == GenerateProgress(
            calls=call,
            sequences=5,
            finished=5,
            tokens=sum(len(o.output_token_ids) - 1 for o in outs),
            max_tokens=5 * max_tokens,
        )
    engine.close()
