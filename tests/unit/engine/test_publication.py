"""Weight publication as docs/model.md §5 defines it, checked through the contract only.

start(version) -> update_weights(chunks)* -> finish(): idle engine only, strictly
increasing versions, chunks checked whole before any copy, copies in place, every
tensor exactly once, KV invalidated, and a failed or partial update blocks generation
until a newer complete one.
"""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import EngineBusy, EngineError, SamplingParams

from .conftest import tiny_model

PROMPTS = [[3, 4, 5, 6], [7, 8, 9]]
PARAMS = SamplingParams(max_tokens=6, seed=1, logprobs=0, exit_threshold=0.5, ignore_eos=True)


@pytest.fixture
def setup(make_engine):
    model = tiny_model(0)
    engine = make_engine(model, max_num_seqs=2, kv_blocks=32, block_size=4)
    new_weights = dict(tiny_model(1).named_parameters())
    yield engine, model, new_weights
    engine.close()


def chunks(weights: dict[str, torch.Tensor], size: int = 7, prefix: str = ""):
    items = [(prefix + name, t.detach().clone()) for name, t in weights.items()]
    return [items[i : i + size] for i in range(0, len(items), size)]


def publish(engine, version, weights, **kw):
    engine.start_weight_update(version)
    for chunk in chunks(weights, **kw):
        engine.update_weights(chunk)
    engine.finish_weight_update()


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_update_in_place_changes_outputs_and_version(setup, make_engine):
    engine, model, new = setup
    before = engine.generate(PROMPTS, PARAMS)
    assert engine.get_weight_version() == 0 and all(o.weight_version == 0 for o in before)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    publish(engine, 5, new, prefix="module.")
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    for name, p in model.named_parameters():
        assert torch.equal(p, new[name])
    after = engine.generate(PROMPTS, PARAMS)
    assert engine.get_weight_version() == 5 and all(o.weight_version == 5 for o in after)
    assert [o.output_token_ids for o in after] != [o.output_token_ids for o in before]
    # the updated engine generates exactly what a fresh engine on the new weights does
    fresh = make_engine(tiny_model(1), max_num_seqs=2, kv_blocks=32, block_size=4)
    try:
        reference = fresh.generate(PROMPTS, PARAMS)
    finally:
        fresh.close()
    for a, b in zip(after, reference, strict=True):
        assert a.output_token_ids == b.output_token_ids and a.exit_depths == b.exit_depths
        assert a.log_probs == b.log_probs


def test_wrapper_prefixes_are_stripped(setup):
    engine, model, new = setup
    publish(engine, 1, new, prefix="module.language_model.")
    assert engine.get_weight_version() == 1
    publish(engine, 2, new, prefix="language_model.")
    assert engine.get_weight_version() == 2


def test_admission_refused_during_update(setup):
    engine, _, new = setup
    engine.start_weight_update(1)
    with pytest.raises(EngineBusy):
        engine.generate(PROMPTS, PARAMS)
    for chunk in chunks(new):
        engine.update_weights(chunk)
    engine.finish_weight_update()
    assert engine.generate(PROMPTS, PARAMS)[0].weight_version == 1


def test_versions_must_increase(setup):
    engine, _, new = setup
    with pytest.raises(EngineError):
        engine.start_weight_update(0)
    publish(engine, 3, new)
    with pytest.raises(EngineError):
        engine.start_weight_update(3)
    with pytest.raises(EngineError):
        engine.start_weight_update(2)
    engine.start_weight_update(7)  # attempted, then abandoned incomplete
    with pytest.raises(EngineError):
        engine.finish_weight_update()
    with pytest.raises(EngineError):  # greater than the committed 3, but not than the attempted 7
        engine.start_weight_update(6)
    publish(engine, 8, new)
    assert engine.get_weight_version() == 8


@pytest.mark.parametrize("bad", ["unknown", "duplicate", "shape", "duplicate_across_chunks"])
def test_bad_chunks_are_rejected_before_any_copy(setup, bad):
    engine, model, new = setup
    good_name = "model.norm.weight"
    good = (good_name, new[good_name].detach().clone())
    engine.start_weight_update(1)
    if bad == "duplicate_across_chunks":
        engine.update_weights([good])
        chunk = [("model.embed_tokens.weight", new["model.embed_tokens.weight"].detach().clone()), good]
    else:
        wrong = {
            "unknown": ("model.layers.0.self_attn.q_bias", torch.zeros(3)),
            "duplicate": good,
            "shape": ("lm_head.weight", torch.zeros(2, 2)),
        }[bad]
        chunk = [good, wrong]
    before = snapshot(model)
    with pytest.raises(EngineError):
        engine.update_weights(chunk)
    after = snapshot(model)
    assert all(torch.equal(before[n], after[n]) for n in before), "a rejected chunk must change nothing"


def test_failed_update_blocks_generation_until_a_newer_complete_one(setup):
    engine, _, new = setup
    engine.start_weight_update(1)
    with pytest.raises(EngineError):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(EngineError, match="committed|failed|newer"):
        engine.generate(PROMPTS, PARAMS)
    with pytest.raises(EngineError):
        engine.finish_weight_update()  # the failed update cannot be completed
    with pytest.raises(EngineError):
        engine.start_weight_update(1)
    publish(engine, 2, new)
    assert engine.generate(PROMPTS, PARAMS)[0].weight_version == 2


def test_partial_update_blocks_generation(setup):
    engine, _, new = setup
    engine.start_weight_update(4)
    first, *_ = chunks(new)
    engine.update_weights(first)
    with pytest.raises(EngineError, match="missing"):
        engine.finish_weight_update()
    assert engine.get_weight_version() == 0
    with pytest.raises(EngineError):
        engine.generate(PROMPTS, PARAMS)
    publish(engine, 5, new)
    assert engine.get_weight_version() == 5
    assert engine.generate(PROMPTS, PARAMS)[0].weight_version == 5


def test_update_invalidates_cached_kv(setup):
    """Publishing the same weights again gives identical outputs (nothing stale survives).
    For the built-in engine the cache is empty once an update starts, and its old contents
    are never read: overwriting them with junk changes no output bit."""
    engine, model, _ = setup
    first = engine.generate(PROMPTS, PARAMS)
    engine.start_weight_update(1)
    kv = getattr(engine, "kv", None)
    if kv is not None:
        assert kv.allocator.num_free == kv.num_blocks
        kv.k.normal_(0, 50)
        kv.v.normal_(0, 50)
    for chunk in chunks(snapshot(model)):
        engine.update_weights(chunk)
    engine.finish_weight_update()
    again = engine.generate(PROMPTS, PARAMS)
    assert [o.output_token_ids for o in first] == [o.output_token_ids for o in again]
    assert [o.log_probs for o in first] == [o.log_probs for o in again]
