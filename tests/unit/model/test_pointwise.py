"""The layer's elementwise functions compile whole (no graph breaks) and match eager.

CUDA runs them compiled; CPU tests run them eager. Compiling them here on CPU (inductor's
C++ backend) checks the same traced graphs that run on a GPU, forward and backward.
"""

from __future__ import annotations

import torch

from ouro_cli.model import compiling, formulas, pointwise
from ouro_cli.settings import executing

from .compiling import ALWAYS, forbid_compiles, record_compiles


def test_compiled_functions_match_eager_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    h, x = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g, requires_grad=True)
    w1, w2 = torch.randn(64, generator=g), torch.randn(64, generator=g)
    q, k = torch.randn(2, 3, 4, 16, generator=g), torch.randn(2, 3, 2, 16, generator=g)
    cos, sin = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    cases = [
        (formulas.add_rms_norm_then_norm, (h, x, w1, w2, 1e-6)),
        (formulas.rotary, (q, k, cos, sin)),
        (formulas.silu_mul, (h, x)),
    ]
    for fn, args in cases:
        eager = fn(*args)
        compiled = compiling.compiled(fn)(*args)
        eager, compiled = (e if isinstance(e, tuple) else (e,) for e in (eager, compiled))
        for a, b in zip(eager, compiled, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    x.grad = None
    compiling.compiled(formulas.add_rms_norm_then_norm)(h, x, w1, w2, 1e-6)[1].sum().backward()
    got = x.grad.clone()
    x.grad = None
    formulas.add_rms_norm_then_norm(h, x, w1, w2, 1e-6)[1].sum().backward()
    torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-5)


def test_cpu_tensors_run_eager(monkeypatch):
    forbid_compiles(monkeypatch)
    x, w = torch.randn(3, 8), torch.ones(8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(pointwise.rms_norm(x, w, 1e-6), expected, rtol=0, atol=0)


def test_eager_block_never_compiles(monkeypatch):
    forbid_compiles(monkeypatch)
    x, w = torch.randn(3, 8), torch.ones(8)
    with executing(ALWAYS):
        with pointwise.eager():
            pointwise.rms_norm(x, w, 1e-6)
        try:
            pointwise.rms_norm(x, w, 1e-6)
        except AssertionError:
            return
    raise AssertionError('outside the eager block, compile="always" must compile')


def test_settings_come_from_the_block_never_the_environment(monkeypatch):
    """The environment's old switch no longer reaches the math; the model's settings do."""
    compiled = record_compiles(monkeypatch)
    monkeypatch.setenv("OURO_COMPILE", "always")
    x, w = torch.randn(3, 8), torch.ones(8)
    pointwise.rms_norm(x, w, 1e-6)  # defaults: eager on CPU
    assert compiled == []
    with executing(ALWAYS):
        pointwise.rms_norm(x, w, 1e-6)
    assert compiled == ["rms_norm"]


def test_compiled_bf16_keeps_eager_roundings():
    """Compiled bf16 results equal eager bit for bit: the roundings of docs/model.md §2's formulas
    (normed value to the activation dtype, then times the weight) are kept, not fused away."""
    g = torch.Generator().manual_seed(1)
    h, x = (torch.randn(2, 5, 256, generator=g).bfloat16() * 3 for _ in range(2))
    w1, w2 = ((torch.rand(256, generator=g) + 0.5).bfloat16() for _ in range(2))
    q, k = (torch.randn(2, 5, 4, 32, generator=g).bfloat16() for _ in range(2))
    cos, sin = (torch.randn(2, 5, 32, generator=g).bfloat16() for _ in range(2))
    for fn, args in [
        (formulas.add_rms_norm_then_norm, (h, x, w1, w2, 1e-6)),
        (formulas.rotary, (q, k, cos, sin)),
        (formulas.silu_mul, (h, x)),
    ]:
        eager, compiled = fn(*args), compiling.compiled(fn)(*args)
        eager, compiled = (e if isinstance(e, tuple) else (e,) for e in (eager, compiled))
        for a, b in zip(eager, compiled, strict=True):
            assert torch.equal(a, b), fn.__name__
