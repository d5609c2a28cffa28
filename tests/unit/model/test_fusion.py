"""Fused q/k/v and gate/up weights: same function, HF parameters become views of them."""

from __future__ import annotations

import torch

from ouro_cli.model import build, fuse_projections, tiny_config


def test_fused_projections_compute_the_same_and_follow_parameter_copies():
    model = build(tiny_config(), seed=0)
    names = [n for n, _ in model.named_parameters()]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 12), generator=g)
    depths = torch.randint(1, 5, (2, 12), generator=g)
    before = model(ids, depths=depths)
    fuse_projections(model)
    fuse_projections(model)  # idempotent
    assert [n for n, _ in model.named_parameters()] == names
    torch.testing.assert_close(model(ids, depths=depths), before, rtol=1e-5, atol=1e-5)

    # publication copies into the parameters in place: the fused matrices must follow
    other = build(tiny_config(), seed=1)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in other.named_parameters():
            params[name].copy_(p)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    torch.testing.assert_close(model(ids, depths=depths), other(ids, depths=depths), rtol=1e-5, atol=1e-5)
