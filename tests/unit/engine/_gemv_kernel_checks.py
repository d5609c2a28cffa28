"""Checks of the small-M linear kernel (ouro_cli/kernels/gemv.py), shared by the CPU
tests (run here as a script under the Triton interpreter, in a process of its own) and the
GPU tests (imported, on CUDA, at the Ouro-1.4B shapes).

Why a subprocess on CPU: TRITON_INTERPRET is read when a kernel is decorated, i.e. when
the kernel module is first imported (see _decode_kernel_checks.py).

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/unit/engine/_gemv_kernel_checks.py [reference ...]
"""

from __future__ import annotations

import sys

import torch

from tests.unit.engine._interpreted import run_checks

# (N, K): N off the 16/32-column tiles (40) and on them (64); K off the default tile (96:
# one masked tile) and on it (256)
SHAPES = [(40, 96), (64, 256), (40, 256), (64, 96)]
ROWS = [1, 3, 8, 16, 40]
# the default tiles, and small ones that take several K steps with a K tail and an N tail
CONFIGS = [{}, {"block_n": 32, "block_k": 64, "num_warps": 2, "num_stages": 2}]


def operands(m: int, n: int, k: int, dtype, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] ~ N(0, 1) and w [n, k] ~ N(0, 1/k), so that outputs are O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(device, dtype), w.to(device, dtype)


def dense_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in fp64 on the operands' own values (bf16 inputs are exact in fp64)."""
    return x.double() @ w.double().T


def assert_close_to_reference(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """fp32: within 1e-5 of fp64. 16-bit: within one rounding of the fp64 product rounded to
    the same dtype (both are a rounding of nearly the same fp32 sum, so at most 1 ulp apart)."""
    ref = dense_reference(x, w)
    assert got.shape == ref.shape and got.dtype == x.dtype, (what, got.shape, got.dtype)
    if x.dtype == torch.float32:
        err = (got.double() - ref).abs().max().item()
        assert err <= 1e-5, f"{what}: |kernel - fp64| = {err:.3g} > 1e-5"
    else:
        ulp = 2.0**-7 if x.dtype == torch.bfloat16 else 2.0**-10
        ref = ref.to(x.dtype).double()
        excess = ((got.double() - ref).abs() - (ulp * ref.abs() + 1e-3)).max().item()
        assert excess <= 0, f"{what}: kernel vs fp64 rounded to {x.dtype} beyond 1 ulp (by {excess:.3g})"


def check_reference(device="cpu", dtype=torch.float32, shapes=SHAPES, rows=ROWS, configs=CONFIGS) -> None:
    """The kernel equals the fp64 product to fp32 precision (fp32) or to 1 ulp (16-bit)."""
    from ouro_cli.kernels.gemv import small_m_linear

    for case, (n, k) in enumerate(shapes):
        for m in rows:
            x, w = operands(m, n, k, dtype, device, seed=case)
            for config in configs:
                assert_close_to_reference(small_m_linear(x, w, **config), x, w, f"N={n} K={k} M={m} {config}")


def check_batch_invariance(
    device="cpu", dtype=torch.float32, shapes=SHAPES[:2], rows=(3, 8, 16, 40, 64), configs=CONFIGS
) -> None:
    """Row i's output is the same bits alone (M = 1), among the first rows of the batch, in the
    whole batch of each size in `rows` (16-, 32- and two 32-row tiles), and with the rows reversed."""
    from ouro_cli.kernels.gemv import small_m_linear

    for case, (n, k) in enumerate(shapes):
        x, w = operands(max(rows), n, k, dtype, device, seed=10 + case)
        for config in configs:
            alone = torch.cat([small_m_linear(x[i : i + 1], w, **config) for i in range(max(rows))])
            for m in rows:
                together = small_m_linear(x[:m], w, **config)
                assert torch.equal(together, alone[:m]), f"N={n} K={k} M={m} {config}: rows changed with M"
                reversed_ = small_m_linear(x[:m].flip(0), w, **config)
                assert torch.equal(reversed_.flip(0), together), f"N={n} K={k} M={m} {config}: rows changed with order"


def check_bad_input(device="cpu") -> None:
    """Shapes and dtypes it does not take raise ValueError before any launch."""
    from ouro_cli.kernels.gemv import small_m_linear

    x, w = operands(4, 32, 64, torch.float32, device)
    bad = {
        "M > 64": (torch.zeros(65, 64, device=device), w),
        "M = 0": (x[:0], w),
        "K mismatch": (x[:, :48], w),
        "dtype mismatch": (x.bfloat16(), w),
        "fp64": (x.double(), w.double()),
        "1-D x": (x[0], w),
        "w strided along K": (x, torch.zeros(64, 32, device=device).T),
    }
    for what, (xb, wb) in bad.items():
        try:
            small_m_linear(xb, wb)
        except ValueError:
            continue
        raise AssertionError(f"{what}: no ValueError")


def check_auto_routing(device="cpu") -> None:
    """`--decode-gemv auto`: the kernel's bits where the shapes are its own (M <= 16, N <=
    8192), F.linear's elsewhere; and the pipeline stages shrink until the tiles fit."""
    import torch.nn.functional as F

    from ouro_cli.kernels import gemv

    for m, n, k, kernel in [(1, 64, 96, True), (16, 40, 256, True), (17, 64, 96, False), (3, 8193, 16, False)]:
        x, w = operands(m, n, k, torch.float32, device)
        expected = gemv.small_m_linear(x, w) if kernel else F.linear(x, w)
        assert torch.equal(gemv.small_m_linear_where_faster(x, w), expected), (m, n, k)
    assert gemv.stages_that_fit(16, 1, 16, 512, 2, 4) == 4  # 3 x 32 KB
    assert gemv.stages_that_fit(32, 2, 16, 512, 2, 4) == 3  # 3 x 80 KB does not fit, 2 x 80 KB does
    assert gemv.stages_that_fit(32, 2, 64, 1024, 2, 4) == 2  # never fewer than 2


CHECKS = {
    "reference_fp32": check_reference,
    "reference_bf16": lambda: check_reference(dtype=torch.bfloat16),
    "batch_invariance_fp32": check_batch_invariance,
    "batch_invariance_bf16": lambda: check_batch_invariance(dtype=torch.bfloat16),
    "bad_input": check_bad_input,
    "auto_routing": check_auto_routing,
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
