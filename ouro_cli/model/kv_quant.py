"""The fp8 KV cache's format (`--kv-cache-dtype fp8`): K and V in float8 e4m3, one scale per token and KV head.

With fp8 K/V the function the engine samples from is a model whose attention reads rounded
K/V; to stay on-policy (docs/model.md §3) the trainer's replay must compute that same
function. So the rounding happens in the model, once, for every caller: each layer call
passes its K and V through `round_trip` before attending (model/layers.py), in the engine's
prefill and decode steps and in the trainer's replay alike. The engine's cache stores what
the layer rounded (`pack`) and gives it back bit for bit (`unpack`), so a decode query attends
over exactly the values the replay attends over.

The scale: one per (token, KV head), a power of two.

- Per token and head, so that a token's rounding is a function of its own head_dim values
  alone: not of the block it lands in, its batch-mates or the micro-batch it is replayed in.
  The engine writes one token at a time, the trainer a whole sequence; a scale per block or
  per tensor would round them differently.
- A power of two, 2^k, so that x / 2^k and q · 2^k are exact: the dequantized values (3
  significant bits times a power of two) are exact in bf16 and fp32 alike, and rounding is
  idempotent, `round_trip(round_trip(x)) == round_trip(x)` bit for bit. The cache re-quantizes
  what the layer already rounded, and a token that exited carries its rounded copy forward
  (docs/model.md §3), without a second rounding. (A scale amax / 448 has neither property.)
- k from exact integer steps, no logarithm: with amax = m · 2^e (frexp, m in [0.5, 1)),
  k = e - 9 when m <= 0.875 (amax / 2^k in [256, 448]) and e - 8 otherwise (in (224, 256)), so
  the largest |x| of a row lands in the top binade of e4m3 (whose largest value is 448).

Storage (`pack`): per (token, head) a row of the head_dim fp8 values, then k as an int8, then
zeros up to a multiple of 16 bytes (`row_bytes`), so the scale travels with its token through
every copy of cache slots (prefix sharing, last-exited copies, the PD transports). The padding
keeps every row 16-byte aligned, which lets the decode kernel load a row in 16-byte vectors
instead of byte by byte: 144 bytes instead of 2 · head_dim in bf16 (256) at head_dim 128.

Where it runs: `round_trip` without a gradient and `pack` on CUDA (and on CPU under the Triton
interpreter) are one kernel each (kernels/fp8_rows.py) with these functions' bits; with a
gradient (the trainer's backward), inside a compiled region and on plain CPU it is the torch
code below.

Gradient: straight-through. The backward treats the rounding as the identity (`round_trip`'s
gradient is the incoming gradient): the gradient of the rounded model at its rounded K/V,
passed on to the unrounded K/V as if the rounding were not there.

The values must be finite (a K or V that is inf or NaN is already a broken forward).
"""

from __future__ import annotations

import torch

from ouro_cli.kernels import interpreted, triton_available

FP8 = torch.float8_e4m3fn
ROW_ALIGN = 16  # a packed row's bytes are a multiple of this (vector loads in the decode kernel)
# k's least value: 2^-126, the least normal fp32, scales rows whose largest |x| is below about
# 2^-117. A row of zeros gets k = -9 (frexp(0) = (0, 0)), not this.
LOWEST_EXPONENT = -126
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes kernels/fp8_rows.py rounds


def row_bytes(head_dim: int, itemsize: int, fp8: bool) -> int:
    """Bytes one token's K (or V) of one KV head takes in the cache: a packed fp8 row (head_dim
    values, the scale's byte, padding to ROW_ALIGN), or head_dim elements of `itemsize` bytes
    (the model's dtype)."""
    return -(-(head_dim + 1) // ROW_ALIGN) * ROW_ALIGN if fp8 else head_dim * itemsize


def exponents(x: torch.Tensor) -> torch.Tensor:
    """k per row of x [..., D] -> int32 [...]: the power of two 2^k that scales the row's
    largest |x| into (224, 448] (module docstring)."""
    mantissa, exponent = torch.frexp(x.abs().amax(-1).float())
    k = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    return k.clamp(min=LOWEST_EXPONENT).int()


def scales(k: torch.Tensor) -> torch.Tensor:
    """2^k in fp32, made from its bits (exact for every normal exponent)."""
    return ((k.int() + 127) << 23).view(torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 values [..., D], exponents k int32 [...]) with x ≈ values · 2^k."""
    k = exponents(x)
    return (x.float() / scales(k)[..., None]).to(FP8), k


def dequantize(values: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 values [..., D] times 2^k [...] in `dtype` (exact: see the module docstring)."""
    return (values.float() * scales(k)[..., None]).to(dtype)


def pack(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> uint8 rows [..., row_bytes(D)]: the fp8 values, k as an int8, then zeros. On
    CUDA (and on CPU under the Triton interpreter) one kernel with `torch_pack`'s bytes."""
    if _kernel_runs(x):
        from ouro_cli.kernels import fp8_rows

        return fp8_rows.pack(x, LOWEST_EXPONENT, row_bytes(x.shape[-1], 1, fp8=True), ROW_ALIGN)
    return torch_pack(x)


def torch_pack(x: torch.Tensor) -> torch.Tensor:
    """`pack` in torch."""
    values, k = quantize(x)
    d = x.shape[-1]
    rows = x.new_zeros((*x.shape[:-1], row_bytes(d, 1, fp8=True)), dtype=torch.uint8)
    rows[..., :d] = values.view(torch.uint8)
    rows[..., d] = k.to(torch.int8).view(torch.uint8)
    return rows


def unpack(rows: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """uint8 rows [..., row_bytes(head_dim)] (`pack`) -> the values [..., head_dim] in `dtype`."""
    return dequantize(rows[..., :head_dim].view(FP8), rows[..., head_dim].view(torch.int8), dtype)


def values(rows: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """K/V read from a cache plane: packed rows (uint8) unpacked into `dtype`; rows of any
    other dtype (an unquantized cache, head_dim wide) as they are."""
    return unpack(rows, dtype, head_dim) if rows.dtype == torch.uint8 else rows


def torch_round_trip(x: torch.Tensor) -> torch.Tensor:
    """quantize -> dequantize in torch: x [..., D] as the fp8 cache holds it, in x's dtype."""
    return dequantize(*quantize(x), x.dtype)


class _RoundTrip(torch.autograd.Function):
    """quantize -> dequantize forward; the identity backward (straight-through)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch_round_trip(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as the fp8 cache holds it, in x's dtype; its gradient passes straight through.
    Without a gradient, on CUDA or under the Triton interpreter: one kernel, the same bits."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RoundTrip.apply(x)
    if _kernel_runs(x):
        from ouro_cli.kernels import fp8_rows

        return fp8_rows.round_trip(x, LOWEST_EXPONENT)
    return torch_round_trip(x)


def _kernel_runs(x: torch.Tensor) -> bool:
    """Whether `round_trip` of x runs kernels/fp8_rows.py: x on CUDA (or on CPU under the
    interpreter) in a dtype it takes, outside a compiled region (which fuses the torch code)."""
    on_kernel_device = x.is_cuda or (x.device.type == "cpu" and interpreted())
    return on_kernel_device and x.dtype in KERNEL_DTYPES and not torch.compiler.is_compiling() and triton_available()
