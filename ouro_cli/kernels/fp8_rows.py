"""The fp8 KV format's rounding (model/kv_quant.py) in Triton: a layer's round trip in one kernel,
and the packed row that the decode kernel writes.

`round_trip` computes kv_quant's torch round trip (a row's max, `frexp`, x / 2^k, the cast to
e4m3, back times 2^k, the cast to x's dtype: about ten kernels a tensor) in one launch, one
program per block of rows, with the same bits; `pack` likewise kv_quant's packed rows (the
cache's writes outside the decode kernel, and the replay's K/V, kernels/replay_attention.py).
The decode kernel (decode_attention.py) calls `quantize` and `pack_row` to write a token's
packed row itself, with `kv_quant.pack`'s bytes.

Everything is integer arithmetic on the values' fp32 bits; no float operation rounds. The
float path would depend on things that differ between Triton's targets: the interpreter's
casts to float8e4nv and to bfloat16 do not round to nearest even (ties go up, a carry out of
the mantissa is lost, fp32 -> bf16 truncates), a GPU's fp32 division is not IEEE unless asked,
and subnormal operands may be flushed. Written out, each step is exact and the same on every
target:

- k (`exponents`): frexp's exponent e of the row's largest |x| is its fp32 exponent field
  minus 126 (for a normal value; its mantissa m <= 0.875 exactly when the fraction bits are
  <= 0x600000), k = e - 9 or e - 8, clamped below at kv_quant.LOWEST_EXPONENT (the callers
  pass it: LOWEST, at least -126, which the shifts below rely on). frexp(0) = (0, 0), so a
  row of zeros gets k = -9; a subnormal maximum has e <= -126, so its k is the clamp's.
- the codes (`e4m3_codes`): |x| = S · 2^e with S its integer significand; x / 2^k lies in a
  binade [2^p, 2^(p+1)) whose e4m3 step is 2^(max(p, -6) - 3) (-6: e4m3's least normal
  exponent, below which the subnormals' step 2^-9 holds); S shifted right onto that step and
  rounded to nearest even is the code's significand N (8..16 for a normal, 0..8 below), and
  the code is 8 · max(p, -6) + 48 + N (N = 16 carries into the next binade by itself). |x| /
  2^k <= 448 by the choice of k, so no code overflows.
- the values (`decoded_bits`): a code's value times 2^k, 4 significant bits at most, is
  assembled as fp32 bits, a subnormal fp32 too; bf16 rounds those bits to nearest even
  (`_from_fp32_bits`), as torch's cast does; fp16 takes the target's cast (round to nearest even
  on CUDA and in the interpreter, numpy's).

CUDA-graph capturable: no host reads, and the grid depends only on the shape. Off CUDA the
kernel runs under the Triton interpreter (the CPU tests compare it with the torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENTS = 4096  # a program's rows x block of head_dim lanes, at most (`round_trip`)


@triton.jit
def fp32_bits(x):
    """x (fp32, bf16 or fp16) -> the int32 bits of its fp32 value (exact: bf16 is fp32's top half)."""
    if x.dtype == tl.bfloat16:
        return x.to(tl.uint16, bitcast=True).to(tl.int32) << 16
    elif x.dtype == tl.float16:
        return x.to(tl.float32).to(tl.int32, bitcast=True)
    else:
        return x.to(tl.int32, bitcast=True)


@triton.jit
def exponents(bits, LOWEST: tl.constexpr):
    """fp32 bits [R, BLOCK_D] (masked lanes 0) -> k [R] int32: kv_quant.exponents of each row."""
    amax = tl.max(bits & 0x7FFFFFFF, 1)  # for finite values the magnitudes' bits order as the magnitudes
    e = (amax >> 23) - 126  # frexp's exponent of a normal amax
    k = tl.where((amax & 0x7FFFFF) <= 0x600000, e - 9, e - 8)  # frexp's mantissa <= 0.875, or above
    k = tl.where((amax >> 23) == 0, LOWEST, k)  # a subnormal amax: e <= -126, clamped below
    k = tl.where(amax == 0, -9, k)  # frexp(0) = (0, 0)
    return tl.maximum(k, LOWEST)


@triton.jit
def e4m3_codes(bits, k):
    """fp32 bits [R, BLOCK_D] and k [R] -> the e4m3 codes (uint8) of x / 2^k rounded to nearest
    even, as torch's cast to float8_e4m3fn gives them (|x| / 2^k <= 448)."""
    mag = bits & 0x7FFFFFFF
    field = mag >> 23
    fraction = mag & 0x7FFFFF
    significand = tl.where(field == 0, fraction, fraction | 0x800000)  # |x| = significand · 2^(exponent)
    exponent = tl.where(field == 0, -149, field - 150)
    # floor(log2 |x|): a subnormal's from its fraction's leading bit (an int below 2^23 converts exactly)
    subnormal_lead = (fraction.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127 - 149
    p = tl.maximum(tl.where(field == 0, subnormal_lead, field - 127) - k[:, None], -6)  # x / 2^k's binade, >= -6
    # the significand's right shift onto the step 2^(p - 3): >= 14 here; past 25 every |x| rounds to 0
    shift = tl.minimum(p - 3 - exponent + k[:, None], 25)
    kept = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    code = 8 * p + 48 + kept + up.to(tl.int32)
    return (code | tl.where(bits < 0, 0x80, 0)).to(tl.uint8)


@triton.jit
def decoded_bits(codes, k):
    """e4m3 codes (uint8) [R, BLOCK_D] and k [R] -> the fp32 bits of each code's value times 2^k
    (exact: 4 significant bits; an fp32 subnormal as such, a value past fp32's range as inf)."""
    c = codes.to(tl.int32)
    field = (c >> 3) & 0xF
    m = c & 7
    significand = tl.where(field == 0, m, m + 8)  # value = significand · 2^f
    f = tl.maximum(field, 1) - 10 + k[:, None]
    lg = tl.where(field == 0, (m >= 2).to(tl.int32) + (m >= 4).to(tl.int32), 3)  # floor(log2 significand)
    lead = lg + f
    normal = ((lead + 127) << 23) | ((significand << (23 - lg)) & 0x7FFFFF)
    normal = tl.where(lead + 127 >= 255, 0x7F800000, normal)
    subnormal = significand << tl.minimum(f + 149, 31)  # f >= -135 (k >= -126), so a left shift
    mag = tl.where(significand == 0, 0, tl.where(lead >= -126, normal, subnormal))
    return mag | (((c >> 7) & 1) << 31)


@triton.jit
def _from_fp32_bits(bits, dtype: tl.constexpr):
    """fp32 bits -> the value in `dtype`, rounded to nearest even (bf16 here, in integers: the
    interpreter's cast truncates)."""
    if dtype == tl.bfloat16:
        mag = bits & 0x7FFFFFFF
        rounded = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
        return (rounded | (((bits >> 31) & 1) << 15)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float16:
        return bits.to(tl.float32, bitcast=True).to(tl.float16)
    else:
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def quantize(x, LOWEST: tl.constexpr):
    """x [R, BLOCK_D] (fp32, bf16 or fp16; masked lanes 0) -> (e4m3 codes [R, BLOCK_D] uint8,
    k [R] int32): kv_quant.quantize (LOWEST: kv_quant.LOWEST_EXPONENT)."""
    bits = fp32_bits(x)
    k = exponents(bits, LOWEST)
    return e4m3_codes(bits, k), k


@triton.jit
def pack_row(codes, k, t):
    """A packed row's bytes (kv_quant.pack) from its codes [R, BLOCK_D] and k [R]: (bytes 0 ..
    D-1, the codes; bytes D + t for t = tl.arange(0, kv_quant.ROW_ALIGN), k as an int8 then
    zeros), to store with masks d < D and D + t < kv_quant.row_bytes(D)."""
    tail = tl.where(t[None, :] == 0, k[:, None], 0).to(tl.int8).to(tl.uint8, bitcast=True)
    return codes, tail


@triton.jit
def _rows_kernel(
    X,
    OUT,
    rows,
    heads,
    stride_xn,
    stride_xh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    LOWEST: tl.constexpr,
    ROW: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Each row of X (rows = N·H rows of D, row r at (r // heads)·stride_xn + (r % heads)·stride_xh)
    quantized: ROW 0, its round trip into OUT [rows, D] in OUT's dtype; else its packed row into
    OUT [rows, ROW] (uint8: the codes, then k and zeros in the ALIGN bytes after them)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    ok = (r < rows)[:, None] & (d < D)[None, :]
    at = (r // heads) * stride_xn + (r % heads) * stride_xh
    x = tl.load(X + at[:, None] + d[None, :], mask=ok, other=0.0)
    codes, k = quantize(x, LOWEST)
    if ROW == 0:
        out = _from_fp32_bits(decoded_bits(codes, k), OUT.dtype.element_ty)
        tl.store(OUT + r[:, None] * D + d[None, :], out, mask=ok)
    else:
        t = tl.arange(0, ALIGN)
        body, tail = pack_row(codes, k, t)
        tl.store(OUT + r[:, None] * ROW + d[None, :], body, mask=ok)
        tail_ok = (r < rows)[:, None] & (D + t < ROW)[None, :]
        tl.store(OUT + r[:, None] * ROW + D + t[None, :], tail, mask=tail_ok)


def round_trip(x: torch.Tensor, lowest_exponent: int) -> torch.Tensor:
    """x [..., D] (fp32, bf16 or fp16, on CUDA or under the interpreter) -> kv_quant.round_trip(x)
    bit for bit, a new contiguous tensor in x's dtype (no gradient); `lowest_exponent`:
    kv_quant.LOWEST_EXPONENT (kv_quant calls this, and this module does not import it)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _launch(x, out, lowest_exponent, row=0, align=1)


def pack(x: torch.Tensor, lowest_exponent: int, row: int, align: int) -> torch.Tensor:
    """x [..., D] (as `round_trip` takes it) -> kv_quant.pack(x) bit for bit: uint8 [..., row], each
    row's D codes, then k as an int8 and zeros up to `row` bytes (kv_quant.row_bytes(D); `align`:
    kv_quant.ROW_ALIGN, at least row - D)."""
    if not 0 < row - x.shape[-1] <= align:
        raise ValueError(f"fp8 pack: a row of {x.shape[-1]} values needs {row} bytes with {align} after the values")
    out = torch.empty((*x.shape[:-1], row), dtype=torch.uint8, device=x.device)
    return _launch(x, out, lowest_exponent, row=row, align=align)


def _launch(x: torch.Tensor, out: torch.Tensor, lowest_exponent: int, row: int, align: int) -> torch.Tensor:
    """Run `_rows_kernel` over x's rows into `out` -> out."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fp8 rows: x must be fp32, bf16 or fp16, got {x.dtype}")
    if lowest_exponent < -126:
        raise ValueError(f"fp8 rows: the lowest exponent must be >= -126, got {lowest_exponent}")
    d = x.shape[-1]
    if out.numel() == 0:
        return out
    # [N, H, D] with the rows' two strides: a head view of a fused projection needs no copy
    rows3 = x.reshape(-1, x.shape[-2] if x.dim() > 1 else 1, d)
    if rows3.stride(-1) != 1:
        rows3 = rows3.contiguous()
    n = rows3.shape[0] * rows3.shape[1]
    block_d = max(16, triton.next_power_of_2(d))
    block_r = max(1, min(ELEMENTS // block_d, triton.next_power_of_2(n)))
    _rows_kernel[(triton.cdiv(n, block_r),)](
        rows3,
        out,
        n,
        rows3.shape[1],
        rows3.stride(0),
        rows3.stride(1),
        D=d,
        BLOCK_D=block_d,
        BLOCK_R=block_r,
        LOWEST=lowest_exponent,
        ROW=row,
        ALIGN=align,
    )
    return out
