"""Padding, packing, gradients, recompute, dtypes and the KV planes handed to kv_sink."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.model import build, tiny_config

T = 4


@pytest.fixture(scope="module")
def model64():
    return build(tiny_config(), dtype=torch.float64, seed=5, std=0.1)


def _seq(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g), torch.randint(1, T + 1, (n,), generator=g)


def test_padding_either_side_matches_single_sequences(model64):
    (a, da), (b, db) = _seq(6, 1), _seq(4, 2)
    solo_a = model64(a[None], depths=da[None])[0]
    solo_b = model64(b[None], depths=db[None])[0]
    for left in (False, True):
        pad = torch.zeros(2, dtype=torch.long)
        ids_b = torch.cat([pad, b]) if left else torch.cat([b, pad])
        dep_b = torch.cat([pad + 1, db]) if left else torch.cat([db, pad + 1])
        mask_b = (
            torch.cat([pad, torch.ones(4, dtype=torch.long)])
            if left
            else torch.cat([torch.ones(4, dtype=torch.long), pad])
        )
        ids = torch.stack([a, ids_b])
        out = model64(
            ids, depths=torch.stack([da, dep_b]), attention_mask=torch.stack([torch.ones(6, dtype=torch.long), mask_b])
        )
        assert torch.allclose(out[0], solo_a, atol=1e-12, rtol=0)
        got_b = out[1, 2:] if left else out[1, :4]
        assert torch.allclose(got_b, solo_b, atol=1e-12, rtol=0)


def test_packing_never_attends_across_documents(model64):
    (a, da), (b, db), (c, dc) = _seq(5, 3), _seq(3, 4), _seq(4, 5)
    packed = torch.cat([a, b, c])[None]
    depths = torch.cat([da, db, dc])[None]
    docs = torch.tensor([[0] * 5 + [1] * 3 + [2] * 4])
    out = model64(packed, depths=depths, document_ids=docs)[0]
    for seq, dep, sl in ((a, da, slice(0, 5)), (b, db, slice(5, 8)), (c, dc, slice(8, 12))):
        assert torch.allclose(out[sl], model64(seq[None], depths=dep[None])[0], atol=1e-12, rtol=0)


def test_gradients_reach_every_tensor_but_the_frozen_gate():
    model = build(tiny_config(), seed=7)
    model.model.early_exit_gate.requires_grad_(False)
    ids, dep = _seq(9, 6)
    model(ids[None], depths=dep[None]).logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        if "early_exit_gate" in name:
            assert p.grad is None, name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_recompute_gives_identical_gradients():
    ids, dep = _seq(9, 8)
    grads = []
    for recompute in (False, True):
        model = build(tiny_config(), seed=9)
        loss = model(ids[None], depths=dep[None], recompute=recompute).log_softmax(-1)[0, :, 3].sum()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_bf16_forward_tracks_fp32():
    ids, dep = _seq(8, 10)
    m32 = build(tiny_config(), seed=11)
    m16 = build(tiny_config(), seed=11, dtype=torch.bfloat16)
    out16 = m16(ids[None], depths=dep[None])
    assert out16.dtype == torch.bfloat16
    ref = m32(ids[None], depths=dep[None])
    assert (out16.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_kv_sink_sees_last_exited_planes(model64):
    ids, _ = _seq(5, 12)
    depths = torch.tensor([[4, 2, 1, 3, 4]])
    planes = {}
    model64(ids[None], depths=depths, kv_sink=lambda t, li, k, v: planes.__setitem__((t, li), (k.clone(), v.clone())))
    assert set(planes) == {(t, li) for t in range(1, T + 1) for li in range(2)}
    for pos, e in enumerate(depths[0].tolist()):
        for t in range(e + 1, T + 1):
            for layer in range(2):
                assert torch.equal(planes[(t, layer)][0][0, pos], planes[(e, layer)][0][0, pos])
                assert torch.equal(planes[(t, layer)][1][0, pos], planes[(e, layer)][1][0, pos])
    # a real plane differs from the previous loop's (the copy is not vacuous)
    assert not torch.equal(planes[(2, 0)][0][0, 0], planes[(1, 0)][0][0, 0])


def test_depths_out_of_range_rejected(model64):
    ids, _ = _seq(3, 13)
    with pytest.raises(ValueError, match="1..4"):
        model64(ids[None], depths=torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="1..4"):
        model64(ids[None], depths=torch.tensor([[5, 1, 2]]))
