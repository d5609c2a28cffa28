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


def _stacked_against_separate(linear, dtype, tol):
    """`linear(x, [w0, w1, w2])` against one product per weight: values and each weight's
    gradient (and the input's) the same, the weights kept separate."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, dtype=dtype, requires_grad=True)
    ws = [torch.randn(n, 8, generator=g, dtype=dtype, requires_grad=True) for n in (6, 3, 3)]
    out = linear(x, ws)
    assert out.shape == (2, 5, 12)
    upstream = torch.randn(out.shape, generator=g, dtype=dtype)
    grads = torch.autograd.grad(out, [x, *ws], upstream)
    x2, ws2 = x.detach().clone().requires_grad_(), [w.detach().clone().requires_grad_() for w in ws]
    separate = torch.cat([linear(x2, w) for w in ws2], -1)
    torch.testing.assert_close(out, separate, rtol=tol, atol=tol)
    for got, want in zip(grads, torch.autograd.grad(separate, [x2, *ws2], upstream), strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_stacked_weights_multiply_as_one_matrix_with_a_gradient_each():
    from ouro_cli.model import exact, matmul

    _stacked_against_separate(matmul.linear, torch.float64, 1e-12)
    _stacked_against_separate(exact.linear, torch.float64, 1e-12)
    # (that a stack keeps every column's bits is the fixed-tile kernel's property, on CUDA:
    # tests/unit/engine/_fixed_tile_checks.py check_fused_columns)
    g = torch.Generator().manual_seed(1)
    x, ws = torch.randn(7, 16, generator=g), [torch.randn(n, 16, generator=g) for n in (8, 4)]
    torch.autograd.gradcheck(
        lambda a, b, c: exact.linear(a, (b, c)),
        (x.double().requires_grad_(), *(w.double().requires_grad_() for w in ws)),
        fast_mode=True,
    )


def test_project_keeps_one_product_per_weight_on_cpu():
    """On CPU the trainer's projections stay one product per weight, as the CPU engine's (the
    CPU tests compare the two bit for bit); a fused matrix, where one exists, is used."""
    from ouro_cli.model.layers import project

    g = torch.Generator().manual_seed(0)
    x, ws = torch.randn(3, 8, generator=g), (torch.randn(4, 8, generator=g), torch.randn(2, 8, generator=g))
    parts = project(x, None, ws)
    assert all(torch.equal(p, x @ w.T) for p, w in zip(parts, ws, strict=True))
    fused = project(x, 2 * torch.cat(ws), ws)  # visibly the fused matrix's product
    assert [p.shape[-1] for p in fused] == [4, 2] and torch.allclose(fused[0], 2 * parts[0])
