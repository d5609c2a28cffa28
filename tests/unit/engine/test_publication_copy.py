"""The fused in-place copy behind weight publication (`publication.copy_into`): it must do
exactly what one `dst.copy_(src)` per pair does — dtype conversion, non-contiguous
sources, one-element groups — and never move a destination's storage."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine.publication import copy_into

from .conftest import tiny_model


def test_copy_into_matches_per_tensor_copy_and_keeps_storage():
    g = torch.Generator().manual_seed(0)
    dsts = [
        torch.zeros(3, 4),
        torch.zeros(4, 3),
        torch.zeros(5, dtype=torch.bfloat16),
        torch.zeros(2, 2),
        torch.zeros(7, dtype=torch.float64),
    ]
    srcs = [
        torch.randn(3, 4, generator=g),
        torch.randn(3, 4, generator=g).t(),  # non-contiguous source
        torch.randn(5, generator=g),  # fp32 into bf16
        torch.randn(2, 2, generator=g, dtype=torch.float64),  # fp64 into fp32
        torch.randn(7, generator=g, dtype=torch.float64),
    ]  # a group of one
    expected = [d.clone().copy_(s) for d, s in zip(dsts, srcs, strict=True)]
    ptrs = [d.data_ptr() for d in dsts]
    copy_into(dsts, srcs)
    assert [d.data_ptr() for d in dsts] == ptrs
    for d, e in zip(dsts, expected, strict=True):
        assert d.dtype == e.dtype and torch.equal(d, e)


def test_copy_into_parameters_under_grad_mode():
    model, new = tiny_model(0), tiny_model(1)
    params = dict(model.named_parameters())
    names = list(params)
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    new_params = dict(new.named_parameters())
    with torch.enable_grad():  # leaf parameters that require grad: the copy must still be allowed
        copy_into([params[n] for n in names], [new_params[n].detach() for n in names])
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    for n in names:
        assert torch.equal(params[n], new_params[n]) and params[n].requires_grad


def test_copy_into_rejects_mismatched_lists():
    with pytest.raises(ValueError):
        copy_into([torch.zeros(1)], [])
