"""The sampling draw's uniforms in one kernel: request_rng.uniform on CUDA.

A decode step draws, for each of its B rows, V uniforms (one per vocabulary entry) from the
row's 64-bit key: element j is splitmix64's output for key + (j + 1)·γ, its top 23 bits
turned into (k + 0.5)·2^-23 (engine/request_rng.py). In torch that is about 20 int64 kernels
over [B, V], each reading and writing the whole array (why: docs/performance.md#decode).
Here one program computes a BLOCK of one row's elements in registers and writes the fp32
uniforms once.

The bits are those of the torch code, which stays the reference and the CPU path: the
arithmetic is the same integer arithmetic, done in uint64, where multiplication wraps mod
2^64 as torch's int64 does and shifts are logical (torch emulates them with a mask), and the
conversion to fp32 is exact (k < 2^23, k + 0.5 has 24 significant bits, 2^-23 is a power of
two). The CPU tests check it bit for bit under the Triton interpreter. Importing this module
needs triton (see kernels/__init__.py). CUDA-graph capturable: no host reads; the grid
depends only on the shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# splitmix64's constants (request_rng.py), as the int64 bit patterns a kernel argument can carry
_GAMMA, _M1, _M2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
BITS = 23
BLOCK = 1024


@triton.jit
def _uniform_kernel(keys, out, n, gamma, m1, m2, BITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys + row).to(tl.uint64, bitcast=True)
    step = gamma.to(tl.uint64, bitcast=True)
    z = key + (j + 1).to(tl.uint64) * step
    z = (z ^ (z >> 30)) * m1.to(tl.uint64, bitcast=True)
    z = (z ^ (z >> 27)) * m2.to(tl.uint64, bitcast=True)
    z = z ^ (z >> 31)
    u = ((z >> (64 - BITS)).to(tl.float32) + 0.5) * (1.0 / (1 << BITS))
    tl.store(out + row.to(tl.int64) * n + j, u, mask=j < n)


def uniform(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys [B] int64 (the keys' bits) on the device -> [B, n] fp32 uniforms in (0, 1), equal
    bit for bit to request_rng.uniform's torch code."""
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"keys must be a 1-d int64 tensor, got {keys.dtype} of shape {tuple(keys.shape)}")
    out = torch.empty(keys.shape[0], n, dtype=torch.float32, device=keys.device)
    if out.numel():
        grid = (keys.shape[0], triton.cdiv(n, BLOCK))
        _uniform_kernel[grid](keys.contiguous(), out, n, _GAMMA, _M1, _M2, BITS=BITS, BLOCK=BLOCK)
    return out
