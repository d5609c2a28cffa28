"""The fp8 KV format (model/kv_quant.py): each row's values are the e4m3 values nearest to
x / 2^k times 2^k, with 2^k the power of two that puts the row's largest |x| in (224, 448]
(checked against a reference that enumerates the 256 e4m3 codes and takes k from a float64
log2); rounding is idempotent to the bit in fp32 and bf16, at the binade edges too, and packing a
row as it is holds the values of its round trip; a row's
rounding does not depend on the other rows it is rounded with; packing stores the rounded
values in head_dim + 1 bytes and unpacks them bit for bit; and the gradient passes straight
through."""

from __future__ import annotations

import math

import pytest
import torch

from ouro_cli.model import kv_quant

E4M3 = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn).double()
E4M3 = E4M3[torch.isfinite(E4M3)].unique()  # the 253 distinct finite values (±0 once, no NaN)


def reference_round_trip(row: list[float]) -> list[float]:
    """One row, in float64: k = ceil(log2(amax / 448)) (at least -126), then the nearest e4m3 value."""
    amax = max(abs(x) for x in row)
    k = max(-126, math.ceil(math.log2(amax / 448))) if amax > 0 else -126
    out = []
    for x in row:
        nearest = E4M3[(E4M3 - x / 2.0**k).abs().argmin()]
        out.append(float(nearest) * 2.0**k)
    return out


def rows(seed: int, n: int = 64, d: int = 16) -> torch.Tensor:
    """Rows of very different sizes (1e-30 .. 1e30), a row of zeros and one with a single value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-30, 31, (n, 1), generator=g)
    x[0] = 0.0
    x[1, 1:] = 0.0
    return x.float()


def test_values_are_the_nearest_e4m3_times_the_rows_power_of_two():
    x = rows(0)
    got = kv_quant.round_trip(x).double()
    for i in range(x.shape[0]):
        want = torch.tensor(reference_round_trip(x[i].double().tolist()), dtype=torch.float64)
        assert torch.equal(got[i], want), i
    # the largest |x| of a row lands in the top binade of e4m3: (224, 448] times 2^k
    k = kv_quant.exponents(x[2:])
    top = x[2:].abs().amax(-1).double() / 2.0 ** k.double()
    assert bool(((top > 224) & (top <= 448)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounding_is_idempotent_to_the_bit(dtype):
    x = rows(1).to(dtype)
    # the binade edges: amax rounding down to 224 (its exponent then drops by one), up to 448, 448 itself
    edges = torch.tensor([[224.0001, 1.0], [447.9, -3.0], [448.0, 0.5], [0.875, 0.001], [0.8751, -0.8751]])
    for data in (x, edges.to(dtype), edges.to(dtype) * 2.0**-100):
        once = kv_quant.round_trip(data)
        assert once.dtype == dtype
        assert torch.equal(kv_quant.round_trip(once), once)
        assert torch.equal(kv_quant.unpack(kv_quant.pack(once), dtype, once.shape[-1]), once)
        # packing rounds as the round trip does: the same values, whether the row was rounded first
        # or not (at a binade edge as another (codes, exponent) pair: x2 the codes, 2^(k-1))
        assert torch.equal(kv_quant.unpack(kv_quant.pack(data), dtype, data.shape[-1]), once)


def test_a_rows_rounding_is_its_own():
    x = rows(2).view(4, 16, 16)  # [tokens, heads, D]
    together = kv_quant.round_trip(x)
    for t in range(4):
        for h in range(16):
            assert torch.equal(kv_quant.round_trip(x[t, h][None]), together[t, h][None])


def test_packed_rows_hold_the_rounded_values_scale_and_zero_padding_in_aligned_rows():
    x = rows(3).view(8, 8, 16)
    packed = kv_quant.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 8, 32)  # 16 values, 1 scale byte, 15 zeros
    assert not packed[..., 17:].any()
    assert [kv_quant.row_bytes(d, 4, fp8=True) for d in (15, 16, 64, 128)] == [16, 32, 80, 144]
    assert kv_quant.row_bytes(16, 2, fp8=False) == 32
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(kv_quant.unpack(packed, dtype, 16), kv_quant.round_trip(x).to(dtype))
        assert torch.equal(kv_quant.values(packed, dtype, 16), kv_quant.unpack(packed, dtype, 16))
    assert kv_quant.values(x, torch.bfloat16, 16) is x  # an unquantized cache's rows pass through


def test_the_gradient_passes_straight_through():
    x = rows(4).requires_grad_()
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    (kv_quant.round_trip(x) * weight).sum().backward()
    assert torch.equal(x.grad, weight)
