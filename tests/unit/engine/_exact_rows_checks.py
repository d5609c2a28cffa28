"""Checks of exact mode's row kernels (ouro_cli/kernels/exact_rows.py), shared by the CPU tests
(run here as a script under the Triton interpreter, in a process of its own) and the GPU tests
(imported, on CUDA, at the Ouro-1.4B widths).

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/unit/engine/_exact_rows_checks.py [reference_fp32 ...]

The references are written out here in float64, independently of the module's formulas.
"""

from __future__ import annotations

import sys

import torch

from tests.unit.engine._interpreted import run_checks

EPS = 1e-6
WIDTHS = [8, 48, 256]  # a power of two, one off it, and several warps' worth
VOCABS = [11, 100, 5000]  # under one lane block, and over one (log-softmax walks in chunks)


def _data(rows: int, width: int, dtype, device, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def _rms_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp64 norm, rounded to the activation dtype, times the weight, rounded: docs/model.md §2."""
    wide = x.double()
    normed = (wide / torch.sqrt((wide * wide).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return (w.double() * normed.double()).to(x.dtype)


def _ulps(dtype) -> float:
    return {torch.float32: 4e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]


def _close(got: torch.Tensor, want: torch.Tensor, dtype, what: str, scale: float = 1.0) -> None:
    err = (got.double() - want.double()).abs().max().item()
    assert err <= 2 * _ulps(dtype) * scale, f"{what}: max error {err}"


def check_reference(device="cpu", dtype=torch.float32, widths=WIDTHS, vocabs=VOCABS) -> None:
    """Each kernel equals its fp64 reference to within a rounding or two of the dtype."""
    from ouro_cli.kernels import exact_rows

    for case, width in enumerate(widths):
        x, h = _data(5, width, dtype, device, case), _data(5, width, dtype, device, 50 + case, scale=4.0)
        w, w2 = (_data(1, width, dtype, device, 100 + case + i)[0] for i in range(2))
        normed = _rms_reference(x, w)
        _close(exact_rows.rms_norm(x, w, EPS), normed, dtype, f"rms_norm {width}", scale=4)
        added = (h.double() + normed.double()).to(dtype)
        _close(exact_rows.add_rms_norm(h, x, w, EPS), added, dtype, f"add_rms_norm {width}", scale=8)
        got_h, got_next = exact_rows.add_rms_norm_then_norm(h, x, w, w2, EPS)
        _close(got_h, added, dtype, f"then_norm's sum {width}", scale=8)
        _close(got_next, _rms_reference(got_h, w2), dtype, f"then_norm's norm {width}", scale=4)
        gate, up = _data(3, width, dtype, device, 200 + case, scale=3.0), _data(3, width, dtype, device, 300 + case)
        g = gate.double()
        silu = (g / (1 + torch.exp(-g))).to(dtype)
        _close(
            exact_rows.silu_mul(gate, up), (silu.double() * up.double()).to(dtype), dtype, f"silu_mul {width}", scale=8
        )
    for case, vocab in enumerate(vocabs):
        logits = _data(4, vocab, torch.float32, device, 400 + case, scale=5.0)
        want = torch.log_softmax(logits.double(), dim=-1)
        err = (exact_rows.log_softmax(logits).double() - want).abs().max().item()
        assert err < 1e-5, f"log_softmax {vocab}: max error {err}"


def check_batch_invariance(device="cpu", dtype=torch.float32, width=256, vocab=5000, rows=(1, 2, 7, 40)) -> None:
    """Row i's bits are the same alone, among the first rows of a batch of each size in `rows`,
    reversed, and (silu·up) at any offset of the flat tensor."""
    from ouro_cli.kernels import exact_rows

    n = max(rows)
    x, h = _data(n, width, dtype, device, 1), _data(n, width, dtype, device, 2, scale=4.0)
    w, w2 = _data(1, width, dtype, device, 3)[0], _data(1, width, dtype, device, 4)[0]
    logits = _data(n, vocab, torch.float32, device, 5, scale=5.0)
    ops = {
        "rms_norm": lambda a, b, c: exact_rows.rms_norm(a, w, EPS),
        "add_rms_norm": lambda a, b, c: exact_rows.add_rms_norm(b, a, w, EPS),
        "then_norm": lambda a, b, c: torch.cat(exact_rows.add_rms_norm_then_norm(b, a, w, w2, EPS), -1),
        "silu_mul": lambda a, b, c: exact_rows.silu_mul(a, b),
        "log_softmax": lambda a, b, c: exact_rows.log_softmax(c),
    }
    for name, op in ops.items():
        alone = torch.cat([op(x[i : i + 1], h[i : i + 1], logits[i : i + 1]) for i in range(n)])
        for m in rows:
            together = op(x[:m], h[:m], logits[:m])
            assert torch.equal(together, alone[:m]), f"{name}: rows changed with the batch of {m}"
            flipped = op(x[:m].flip(0), h[:m].flip(0), logits[:m].flip(0)).flip(0)
            assert torch.equal(flipped, together), f"{name}: rows changed with their order ({m})"
    flat = exact_rows.silu_mul(x.flatten()[3:], h.flatten()[3:])  # every element at another place in its block
    assert torch.equal(flat, exact_rows.silu_mul(x, h).flatten()[3:]), "silu_mul: an element changed with its place"


def check_gradients(device="cpu", dtype=torch.float32, width=48) -> None:
    """Backward gives autograd's gradients of the plain formulas (model/formulas.py) at the same
    inputs, for every argument and output; forwards without grad need no graph. Off CUDA the
    pullback runs eager, the same ops as autograd's, so the bits must match; on CUDA it is
    compiled (fused, another rounding order): within fp32's rounding, or bf16's, of the
    largest gradient."""
    from ouro_cli.kernels import exact_rows
    from ouro_cli.model import formulas

    x, h = _data(6, width, dtype, device, 7), _data(6, width, dtype, device, 8, scale=4.0)
    w, w2 = _data(1, width, dtype, device, 9)[0], _data(1, width, dtype, device, 10)[0]
    gate = _data(6, width, dtype, device, 11, scale=3.0)
    logits = _data(6, 100, torch.float32, device, 12, scale=5.0)
    cases = {
        "rms_norm": (exact_rows.rms_norm, formulas.rms_norm, (x, w), (EPS,)),
        "add_rms_norm": (exact_rows.add_rms_norm, formulas.add_rms_norm, (h, x, w), (EPS,)),
        "then_norm": (exact_rows.add_rms_norm_then_norm, formulas.add_rms_norm_then_norm, (h, x, w, w2), (EPS,)),
        "silu_mul": (exact_rows.silu_mul, formulas.silu_mul, (gate, x), ()),
        "log_softmax": (exact_rows.log_softmax, lambda t: torch.log_softmax(t, -1), (logits,), ()),
    }
    for name, (kernel, plain, tensors, extra) in cases.items():
        grads = []
        for fn in (kernel, plain):
            leaves = [t.clone().requires_grad_(True) for t in tensors]
            outs = fn(*leaves, *extra)
            outs = outs if isinstance(outs, tuple) else (outs,)
            seeds = [_data(o.shape[0], o.shape[-1], o.dtype, device, 20 + i).view_as(o) for i, o in enumerate(outs)]
            grads.append(torch.autograd.grad(outs, leaves, seeds))
        for i, (a, b) in enumerate(zip(*grads, strict=True)):
            if device == "cpu":
                assert torch.equal(a, b), f"{name}: gradient of argument {i} differs from the plain formula's"
            else:
                rtol = 1e-5 if a.dtype == torch.float32 else 2e-2
                torch.testing.assert_close(
                    a, b, rtol=rtol, atol=rtol * float(b.abs().max()), msg=f"{name}: gradient of argument {i}"
                )
    with torch.no_grad():
        assert exact_rows.rms_norm(x.requires_grad_(True), w, EPS).grad_fn is None


def _truncated(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits: the Triton interpreter's cast (the GPU's rounds
    to nearest even)."""
    assert dtype == torch.bfloat16, dtype
    return (x.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cast=lambda t, dtype: t.to(dtype)):
    """RoPE written out: each product in fp32 cast to x's dtype, their sum in fp32 cast again."""
    half = x.shape[-1] // 2
    c, s = cos.unsqueeze(2).float(), sin.unsqueeze(2).float()
    rot = torch.cat((-x[..., half:], x[..., :half]), -1).float()
    return cast(cast(x.float() * c, x.dtype).float() + cast(rot * s, x.dtype).float(), x.dtype)


def check_rotary(device="cpu", dtype=torch.float32, heads=(4, 2), head_dim=16, positions=(2, 5)) -> None:
    """RoPE's kernel equals the eager formula (model/formulas.py `rotary`, which equals it
    written out with each rounding) bit for bit: on contiguous q and k, on q and k that are
    views of one fused [q;k;v] output, and (its bits a function of the position alone) a
    position alone as among all. In bf16 under the interpreter, whose casts truncate, it equals
    the written-out formula with truncating casts. Its gradients are autograd's of the formula
    (bitwise off CUDA, as check_gradients says)."""
    from ouro_cli.kernels import exact_rows
    from ouro_cli.model import formulas

    b, s = positions
    hq, hkv = heads
    qkv = _data(b * s, (hq + 2 * hkv) * head_dim, dtype, device, 30, scale=2.0).view(b, s, -1)
    q_view, k_view, _ = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], -1)
    q_view, k_view = q_view.view(b, s, hq, head_dim), k_view.view(b, s, hkv, head_dim)
    angles = _data(b * s, head_dim, torch.float64, "cpu", 31).view(b, s, head_dim)
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    assert exact_rows.rotary_supported(q_view)
    for q, k in ((q_view, k_view), (q_view.contiguous(), k_view.contiguous())):
        got = exact_rows.rotary(q, k, cos, sin)
        if device == "cpu" and dtype != torch.float32:  # the interpreter truncates to 16 bits
            want = tuple(_rotated(x, cos, sin, _truncated) for x in (q, k))
        else:
            want = formulas.rotary(q, k, cos, sin)
            assert all(torch.equal(a, b_) for a, b_ in zip(want, (_rotated(x, cos, sin) for x in (q, k)), strict=True))
        for name, a, b_ in zip("qk", got, want, strict=True):
            assert torch.equal(a, b_), f"rotary {name}: differs from the eager formula"
    alone = exact_rows.rotary(q_view[1:, 3:4], k_view[1:, 3:4], cos[1:, 3:4], sin[1:, 3:4])
    assert all(torch.equal(a[0, 0], full[1, 3]) for a, full in zip(alone, got, strict=True))
    grads = []
    for fn in (exact_rows.rotary, formulas.rotary):
        leaves = [t.clone().requires_grad_(True) for t in (q_view, k_view)]
        outs = fn(*leaves, cos, sin)
        seeds = [_data(o.numel(), 1, o.dtype, device, 40 + i).view_as(o) for i, o in enumerate(outs)]
        grads.append(torch.autograd.grad(outs, leaves, seeds))
    for name, a, b_ in zip("qk", *grads, strict=True):
        if device == "cpu":
            assert torch.equal(a, b_), f"rotary: gradient of {name} differs from the plain formula's"
        else:
            rtol = 1e-5 if a.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(a, b_, rtol=rtol, atol=rtol * float(b_.abs().max()), msg=f"rotary {name}")
    assert not exact_rows.rotary_supported(torch.empty(1, 1, 1, 12))  # half of 12 is not a power of two


CHECKS = {
    "reference_fp32": check_reference,
    "reference_bf16": lambda: check_reference(dtype=torch.bfloat16),
    "batch_invariance_fp32": check_batch_invariance,
    "batch_invariance_bf16": lambda: check_batch_invariance(dtype=torch.bfloat16),
    "gradients_fp32": check_gradients,
    "gradients_bf16": lambda: check_gradients(dtype=torch.bfloat16),
    "rotary_fp32": check_rotary,
    "rotary_bf16": lambda: check_rotary(dtype=torch.bfloat16),
    "rotary_gqa_odd_heads": lambda: check_rotary(heads=(3, 1), head_dim=8),
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
