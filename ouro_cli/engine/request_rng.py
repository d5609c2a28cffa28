"""Per-request random numbers: draw n of a request is a pure function of (seed, n).

Each request owns a `RequestRng`. A draw takes the next counter value, hashes it with
the seed into a 64-bit key on the host, and expands the key on the device into as many
numbers as asked (`uniform`, `exponential`): element j is the splitmix64 output for
state key + (j+1)·γ. A row's numbers therefore depend only on its own seed and how many
draws it made, never on its batch-mates or on the batch size, and the numbers of a
whole batch come from one vectorized hash: on CUDA one Triton kernel (kernels/uniform.py),
elsewhere a fixed number of torch kernels, with the same bits.

Why not a `torch.Generator` per request: a generator fills one tensor per call, so a
step would draw its batch's sampling noise with one launch per row.
Integer arithmetic is exact on every device, so the keys and hashed bits are the same
on CPU and CUDA; only the final fp32 `log` may round differently across devices.
"""

from __future__ import annotations

import numpy as np
import torch

from ouro_cli.host_to_device import to_device

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_BITS = 23  # uniforms are (k + 0.5)·2^-23, k < 2^23: exact in fp32, never 0 or 1


def _mix(z: int) -> int:
    """splitmix64's finalizer on a Python int (64-bit wrap-around)."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _signed(z: int) -> int:
    return z - (1 << 64) if z >= 1 << 63 else z


class RequestRng:
    """The random stream of one request. `next_key` advances it by one draw."""

    def __init__(self, seed: int) -> None:
        self.seed = seed & _MASK
        self.draws = 0

    def next_key(self) -> int:
        key = _mix(self.seed ^ _mix((self.draws + 1) * _GAMMA & _MASK))
        self.draws += 1
        return key


def next_keys(rngs: list[RequestRng], draw: list[bool]) -> np.ndarray:
    """`next_key` of every stream whose `draw` is set, 0 for the others (which do not advance),
    as one int64 array of the keys' bits: the batch's keys in a few numpy operations instead of
    two Python hashes per row (uint64 arithmetic wraps mod 2^64 like `_mix`)."""
    seeds = np.array([r.seed for r in rngs], dtype=np.uint64)
    counters = np.array([r.draws + 1 for r in rngs], dtype=np.uint64)
    for rng, drawn in zip(rngs, draw, strict=True):
        rng.draws += drawn
    keys = _mix_array(seeds ^ _mix_array(counters * np.uint64(_GAMMA)))
    keys[~np.array(draw, dtype=bool)] = 0
    return keys.view(np.int64)


def _mix_array(z: np.ndarray) -> np.ndarray:
    """`_mix` on a uint64 array."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def _shift_right(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def uniform(keys: list[int] | np.ndarray, n: int, device: torch.device | str) -> torch.Tensor:
    """[len(keys), n] fp32 uniforms in (0, 1); row i expands draw key `keys[i]` (a Python int,
    or `next_keys`' int64 bits)."""
    signed = torch.from_numpy(keys) if isinstance(keys, np.ndarray) else [_signed(x) for x in keys]
    k = to_device(signed, torch.long, device)
    if _fused(k):
        from ouro_cli.kernels.uniform import uniform as fused_uniform

        return fused_uniform(k, n)
    return torch_uniform(k, n)


def torch_uniform(k: torch.Tensor, n: int) -> torch.Tensor:
    """`uniform` of the keys' bits k [B] (int64, on any device) in torch: the reference, and the
    path off CUDA. On CUDA kernels/uniform.py computes the same bits in one kernel instead of
    about 20 over [B, n]."""
    device = k.device
    z = k[:, None] + torch.arange(1, n + 1, dtype=torch.long, device=device) * _signed(_GAMMA)  # wraps mod 2^64
    z = (z ^ _shift_right(z, 30)) * _signed(_M1)
    z = (z ^ _shift_right(z, 27)) * _signed(_M2)
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 64 - _BITS).float() + 0.5) * 2.0**-_BITS


def _fused(k: torch.Tensor) -> bool:
    """Whether the draw runs as one Triton kernel: on CUDA, where triton is installed (the CPU
    tests run that kernel under the Triton interpreter and compare it with `torch_uniform`)."""
    from ouro_cli.kernels import triton_available

    return k.is_cuda and triton_available()


def exponential(keys: list[int] | np.ndarray, n: int, device: torch.device | str) -> torch.Tensor:
    """[len(keys), n] fp32 Exp(1) draws (-log of `uniform`)."""
    return -torch.log(uniform(keys, n, device))


def reference_uniform(key: int, j: int) -> float:
    """Element j of a draw with `key`, in pure Python: what `uniform` must compute."""
    z = _mix((key + (j + 1) * _GAMMA) & _MASK)
    return ((z >> (64 - _BITS)) + 0.5) * 2.0**-_BITS
