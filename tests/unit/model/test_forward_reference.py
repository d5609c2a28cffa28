"""The model's whole-sequence forward equals an independent per-token fp64 reference:
full depth, uniform decode budget K, and mixed per-token depths with last-exited KV."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.model import build, tiny_config

from .reference import reference_logits

SEQ = 7


@pytest.fixture(scope="module")
def cfg():
    return tiny_config(
        vocab_size=48, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2
    )


@pytest.fixture(scope="module")
def model64(cfg):
    return build(cfg, dtype=torch.float64, seed=3, std=0.2)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 48, (SEQ,), generator=torch.Generator().manual_seed(0)).tolist()


def _depth_cases(T: int) -> dict[str, list[int]]:
    prompt = 3
    return {
        "full": [T] * SEQ,
        **{f"uniform_K{k}": [T] * prompt + [k] * (SEQ - prompt) for k in range(1, T + 1)},
        "mixed": [T, T, T, 1, 3, 2, 1],
        "mixed_prompt_shallow": [2, 4, 1, 3, 1, 4, 2],
    }


@pytest.mark.parametrize("case", list(_depth_cases(4)))
def test_fp64_model_equals_reference(model64, cfg, tokens, case):
    depths = _depth_cases(cfg.total_ut_steps)[case]
    expected = reference_logits(model64.state_dict(), cfg, tokens, depths)
    ids = torch.tensor([tokens])
    got = model64(ids, depths=torch.tensor([depths]))[0]
    assert torch.allclose(got, expected, atol=1e-10, rtol=0), (got - expected).abs().max()
    if case == "full":
        assert torch.allclose(model64(ids)[0], expected, atol=1e-10, rtol=0)


def test_fp32_model_close_to_reference(model64, cfg, tokens):
    depths = _depth_cases(cfg.total_ut_steps)["mixed"]
    expected = reference_logits(model64.state_dict(), cfg, tokens, depths)
    model32 = build(cfg, dtype=torch.float32, seed=3, std=0.2)
    got = model32(torch.tensor([tokens]), depths=torch.tensor([depths]))[0].double()
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


def test_reference_detects_wrong_kv_plane(model64, cfg, tokens):
    """Guard that the comparison can fail: depths differing at one position change later logits."""
    a = reference_logits(model64.state_dict(), cfg, tokens, [4, 4, 4, 1, 3, 2, 1])
    b = reference_logits(model64.state_dict(), cfg, tokens, [4, 4, 4, 2, 3, 2, 1])
    assert (a[4:] - b[4:]).abs().max() > 1e-4
    assert torch.equal(a[:3], b[:3])


def test_uniform_budget_equals_full_compute_read_at_loop_k(model64, cfg, tokens):
    """docs/model.md §3: with uniform K and no exits, the decode positions' logits equal the
    plain full-compute model read at loop K (prompt positions still run T loops)."""
    T = cfg.total_ut_steps
    ids = torch.tensor([tokens])
    for k in range(1, T + 1):
        got = model64(ids, depths=torch.tensor([[T] * 3 + [k] * (SEQ - 3)]))[0]
        plain = reference_logits(model64.state_dict(), cfg, tokens, [T] * 3 + [k] * (SEQ - 3))
        assert torch.allclose(got, plain, atol=1e-10, rtol=0)
