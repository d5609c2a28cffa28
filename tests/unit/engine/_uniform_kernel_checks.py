"""Checks of the sampling draw's kernel (ouro_cli/kernels/uniform.py), shared by the CPU tests
(run here as a script under the Triton interpreter, in a process of its own) and the GPU
tests (imported, on CUDA, at the decode step's shape).

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/unit/engine/_uniform_kernel_checks.py [torch_bits ...]
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from tests.unit.engine._interpreted import run_checks

# seeds whose keys cover the sign bit's both sides; key 0 (a greedy row's, which draws nothing)
SEEDS = [0, 1, 2**63 + 5, 2**64 - 1, 12345, 987654321]


def keys(device) -> torch.Tensor:
    from ouro_cli.engine.request_rng import RequestRng, next_keys

    rngs = [RequestRng(s) for s in SEEDS]
    for rng in rngs[:3]:
        rng.draws = 7  # some streams further along
    drawn = next_keys(rngs, [True] * (len(SEEDS) - 1) + [False])
    return torch.from_numpy(drawn).to(device)


def check_torch_bits(device="cpu", widths=(1, 7, 1024, 1025, 3000)) -> None:
    """Every element equals the torch reference's bits, on and off the block, and the pure
    Python reference at a few elements."""
    from ouro_cli.engine.request_rng import reference_uniform, torch_uniform
    from ouro_cli.kernels.uniform import uniform

    k = keys(device)
    for n in widths:
        got, want = uniform(k, n), torch_uniform(k, n)
        assert got.dtype == torch.float32 and got.shape == (len(SEEDS), n), (got.dtype, got.shape)
        assert torch.equal(got, want), f"n={n}: {int((got != want).sum())} of {got.numel()} differ"
    for row, key in enumerate(k.tolist()):
        for j in (0, widths[-1] - 1):
            assert float(got[row, j]) == reference_uniform(key & ((1 << 64) - 1), j), (row, j)


def check_rows_alone(device="cpu") -> None:
    """A row's uniforms are the same alone as in its batch."""
    from ouro_cli.kernels.uniform import uniform

    k = keys(device)
    batch = uniform(k, 2000)
    for row in range(len(SEEDS)):
        assert torch.equal(uniform(k[row : row + 1], 2000)[0], batch[row]), row


def check_bad_input(device="cpu") -> None:
    from ouro_cli.kernels.uniform import uniform

    for bad in (keys(device).to(torch.int32), keys(device)[:, None]):
        try:
            uniform(bad, 8)
        except ValueError as err:
            assert "1-d int64" in str(err), err
        else:
            raise AssertionError(f"{bad.dtype} {tuple(bad.shape)} was accepted")
    assert uniform(torch.from_numpy(np.zeros(0, dtype=np.int64)).to(device), 5).shape == (0, 5)


CHECKS = {"torch_bits": check_torch_bits, "rows_alone": check_rows_alone, "bad_input": check_bad_input}

if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
