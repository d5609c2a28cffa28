"""`ouro_cli.hf`: the transformers model computes our model's logits, at full depth and, through
its per-loop cache, at a decode budget K (checked against the depth replay, docs/model.md §3)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import ouro_cli.hf  # noqa: E402,F401  (registers Ouro with the Auto classes)
from ouro_cli.checkpoint import write_hf  # noqa: E402
from ouro_cli.hf.modeling import CACHE_FIELD  # noqa: E402
from ouro_cli.model import build, tiny_config  # noqa: E402

T = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours, the transformers model read back from the directory ours was written to)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("hf")
    ours = build(tiny_config(), seed=3)
    write_hf(out, ours.config, ours.state_dict().items())
    return ours, AutoModelForCausalLM.from_pretrained(out).eval()


def test_from_pretrained_builds_our_model_with_our_weights(models):
    ours, hf = models
    assert type(hf) is ouro_cli.hf.OuroForCausalLM and hf.config.to_ouro().total_ut_steps == T
    assert sorted(hf.state_dict()) == sorted(ours.state_dict())
    assert all(torch.equal(t, ours.state_dict()[n]) for n, t in hf.state_dict().items())


@torch.no_grad()
def test_full_depth_logits_are_our_models_with_padding_on_the_left(models):
    ours, hf = models
    ids = torch.tensor([[5, 9, 17, 33, 4, 60]])
    assert torch.equal(hf(ids).logits, ours(ids))
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    logits = hf(padded, attention_mask=mask).logits[:, 2:]
    torch.testing.assert_close(logits, ours(ids), rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("loops", [[1, 1, 1], [2, 2, 2], [T, T, T], [2, T, 3]], ids=["k1", "k2", "kT", "mixed"])
def test_cached_decoding_is_the_replay_at_the_same_depths(models, loops):
    """The prompt at full depth, then three tokens one at a time through the cache, token j at
    `loops[j]` loops: the logits of every step are those the replay gives the whole sequence
    with depths [T]*m + loops (docs/model.md §3: what the engine and the trainer agree on).
    Mixed depths read the last-exited K/V that a shallower token left in the deeper planes."""
    ours, hf = models
    prompt, appended = [5, 9, 17, 33], [4, 60, 21]
    out = hf(torch.tensor([prompt]), use_cache=True)
    steps = [out.logits[0, -1]]
    for token, k in zip(appended, loops, strict=True):
        out = hf(torch.tensor([[token]]), **{CACHE_FIELD: out[CACHE_FIELD]}, use_cache=True, max_loops=k)
        steps.append(out.logits[0, -1])
    ids = torch.tensor([prompt + appended])
    depths = torch.tensor([[T] * len(prompt) + loops])
    replay = ours(ids, depths=depths)[0, len(prompt) - 1 :]
    torch.testing.assert_close(torch.stack(steps), replay, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_labels_give_the_next_token_loss(models):
    ours, hf = models
    ids = torch.tensor([[5, 9, 17, 33, 4]])
    labels = ids.clone()
    labels[0, 2] = -100
    expected = torch.nn.functional.cross_entropy(ours(ids)[0, :-1], torch.tensor([9, -100, 33, 4]))
    torch.testing.assert_close(hf(ids, labels=labels).loss, expected)


def test_bad_depths_and_inputs_are_refused(models):
    _, hf = models
    ids = torch.tensor([[5, 9]])
    with pytest.raises(ValueError, match="max_loops must lie in 1..4"):
        hf(ids, max_loops=5)
    with pytest.raises(ValueError, match="needs use_cache=True"):
        hf(ids, max_loops=2, use_cache=False)
    with pytest.raises(ValueError, match="not inputs_embeds"):
        hf(inputs_embeds=torch.zeros(1, 2, 64))
