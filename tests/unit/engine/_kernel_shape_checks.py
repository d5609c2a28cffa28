"""Property checks of every Triton kernel we own over drawn shapes (hypothesis), shared by the
CPU tests (a small budget under the Triton interpreter, in a process of its own) and the GPU
tests (a larger one, and once under compute-sanitizer memcheck):

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/unit/engine/_kernel_shape_checks.py [name ...]
    OURO_SHAPE_EXAMPLES=200 PYTHONPATH=. compute-sanitizer --tool memcheck python
    tests/unit/engine/_kernel_shape_checks.py

Each check draws the shapes the kernels meet in real jobs, edges first: context lengths of 1
to LONGEST (prompts up to 1,024 tokens on the GPU), lengths on a KV tile's boundary and one
past it, row counts of 1 to ROWS, head groups G of 1 to 3, widths that are not multiples of
16 or 64; and compares the kernel with its plain reference (bits where the kernel promises
bits: a row alone and in its batch, the uniforms). OURO_SHAPE_EXAMPLES sets the examples per
check; the derandomized draws make a run repeatable.
"""

from __future__ import annotations

import os
import sys

import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.unit.engine._interpreted import run_checks

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if CUDA else "cpu"
EXAMPLES = int(os.environ.get("OURO_SHAPE_EXAMPLES", "40" if CUDA else "6"))
LONGEST = 1024 if CUDA else 140  # context positions (the interpreter walks every tile in Python)
ROWS = 512 if CUDA else 24
TILE = 64  # decode_attention.BLOCK

# On a GPU a bad access poisons the CUDA context, so every later example fails too: report the
# first failing draw as drawn instead of shrinking it into a draw that did not fail by itself.
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate] if CUDA else list(Phase),
)
VERBOSE = os.environ.get("OURO_SHAPE_VERBOSE") == "1"  # print each draw before it runs


def _length() -> st.SearchStrategy[int]:
    """A context length: an edge (1, a tile's end, one past it), or anything up to LONGEST."""
    edges = [1, 2, TILE - 1, TILE, TILE + 1, 2 * TILE, 2 * TILE + 1, LONGEST]
    return st.one_of(st.sampled_from([e for e in edges if e <= LONGEST]), st.integers(1, LONGEST))


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _attention_reference(q, k_plane, v_plane, ctx, lengths) -> torch.Tensor:
    """fp64 softmax attention of each row over its first `length` slots, all rows at once."""
    b, hq, d = q.shape
    g = hq // k_plane.shape[0]
    width = int(lengths.max())
    slots = ctx[:, :width].cpu()
    k = k_plane.cpu().double()[:, slots].repeat_interleave(g, 0)  # [Hq, B, W, D]
    v = v_plane.cpu().double()[:, slots].repeat_interleave(g, 0)
    scores = torch.einsum("bhd,hbwd->bhw", q.cpu().double(), k) * d**-0.5
    seen = torch.arange(width)[None, None, :] < lengths.cpu()[:, None, None]
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
    return torch.einsum("bhw,hbwd->bhd", weights, v)


@SETTINGS
@given(
    lengths=st.lists(_length(), min_size=1, max_size=12),
    hkv=st.integers(1, 2),
    g=st.integers(1, 3),
    d=st.sampled_from([16, 24, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def check_decode_attention(lengths, hkv, g, d, dtype, seed) -> None:
    """paged_decode_attention: every row equals the fp64 reference, and alone has its bits in
    the batch (the scratch-padded slot table wider than every row, as the engine builds it)."""
    from ouro_cli.kernels.decode_attention import paged_decode_attention

    gen = _generator(seed)
    b, used = len(lengths), sum(lengths)
    k_plane, v_plane = (torch.randn(hkv, used + 1, d, generator=gen).to(DEVICE, dtype) for _ in range(2))
    width = max(lengths) + int(torch.randint(0, TILE, (1,), generator=gen))
    ctx = torch.full((b, width), used, dtype=torch.long)  # past its length a row points at the scratch slot
    perm, at = torch.randperm(used, generator=gen), 0
    for row, n in enumerate(lengths):
        ctx[row, :n] = perm[at : at + n]
        at += n
    ctx, lens = ctx.to(DEVICE), torch.tensor(lengths, device=DEVICE)
    q = torch.randn(b, hkv * g, d, generator=gen).to(DEVICE, dtype)
    out = paged_decode_attention(q, k_plane, v_plane, ctx, lens)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (out.cpu().double() - _attention_reference(q, k_plane, v_plane, ctx, lens)).abs().max().item()
    assert err <= tol, f"lengths {lengths}: max error {err}"
    row = int(torch.randint(0, b, (1,), generator=gen))
    alone = paged_decode_attention(
        q[row : row + 1], k_plane, v_plane, ctx[row : row + 1, : lengths[row]], lens[row : row + 1]
    )
    assert torch.equal(alone, out[row : row + 1]), f"row {row} of lengths {lengths} changed alone"


@SETTINGS
@given(
    b=st.integers(1, 4),
    s=_length(),
    hkv=st.integers(1, 2),
    g=st.integers(1, 2),
    part=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**16),
)
@example(b=4, s=1, hkv=1, g=1, part=1.0, seed=0)  # one position per row: its lengths are a broadcast view
def check_replay_attention(b, s, hkv, g, part, seed) -> None:
    """The replay's attention through the blocked decode kernel (replay_attention.paged_forward):
    causal over B x S equals SDPA; the queries of a drawn subset of positions (a gathered loop)
    get the bits they have among all."""
    from ouro_cli.kernels.replay_attention import forget, paged_forward
    from ouro_cli.model.attention import sdpa_attention

    s = max(1, min(s, 4096 // b))
    if VERBOSE:
        print(f"replay_attention b={b} s={s} hkv={hkv} g={g} part={part} seed={seed}", flush=True)
    gen = _generator(seed)
    q, k, v = (torch.randn(b, s, heads, 16, generator=gen).to(DEVICE) for heads in (hkv * g, hkv, hkv))
    try:
        out = paged_forward(q, k, v, None)
        err = (out.double() - sdpa_attention(q, k, v, None).double()).abs().max().item()
        assert err <= 1e-4, f"B {b} S {s}: max error {err}"
        rows = torch.nonzero(torch.rand(b * s, generator=gen) < part).squeeze(1).to(DEVICE)
        if rows.numel():
            some = paged_forward(q.reshape(1, b * s, hkv * g, 16)[:, rows], k, v, None, rows=rows)
            assert torch.equal(some[0], out.reshape(b * s, hkv * g, 16)[rows]), f"B {b} S {s}: rows changed"
    finally:
        forget()


@SETTINGS
@given(
    m=st.one_of(st.sampled_from([1, 63, 64, 65, 128, 129, 256, 257]), st.integers(1, ROWS)),
    n=st.sampled_from([1, 24, 64, 130, 200]),
    k=st.sampled_from([16, 40, 64, 96, 200]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def check_fixed_tile(m, n, k, dtype, seed) -> None:
    """fixed_tile_linear at any row count: the fp64 reference to a rounding, and a drawn row
    alone has its bits in the batch."""
    from ouro_cli.kernels.fixed_tile import fixed_tile_linear
    from tests.unit.engine._gemv_kernel_checks import assert_close_to_reference, operands

    x, w = operands(m, n, k, dtype, DEVICE, seed)
    y = fixed_tile_linear(x, w)
    assert_close_to_reference(y, x, w, f"fixed tile {m}x{n}x{k}")
    row = seed % m
    assert torch.equal(fixed_tile_linear(x[row : row + 1], w), y[row : row + 1]), f"row {row} of {m} changed alone"


@SETTINGS
@given(
    m=st.integers(1, 64),
    n=st.sampled_from([8, 24, 130, 256]),
    k=st.sampled_from([16, 40, 128, 200]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def check_gemv(m, n, k, dtype, seed) -> None:
    """small_m_linear (the decode step's small-batch matmul) at 1 to 64 rows: the reference."""
    from ouro_cli.kernels.gemv import small_m_linear
    from tests.unit.engine._gemv_kernel_checks import assert_close_to_reference, operands

    x, w = operands(m, n, k, dtype, DEVICE, seed)
    assert_close_to_reference(small_m_linear(x, w), x, w, f"gemv {m}x{n}x{k}")


@SETTINGS
@given(
    rows=st.integers(1, ROWS),
    width=st.sampled_from([8, 48, 100, 256, 2048]),
    vocab=st.sampled_from([11, 4096, 4097, 50000 if CUDA else 5000]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def check_row_kernels(rows, width, vocab, dtype, seed) -> None:
    """exact_rows' norms, silu·up, log-softmax and RoPE at any row count: a drawn row alone has
    its bits in the batch, and the norm and log-softmax equal their fp64 references."""
    from ouro_cli.kernels import exact_rows
    from tests.unit.engine._exact_rows_checks import _close, _data, _rms_reference

    x, h = _data(rows, width, dtype, DEVICE, seed), _data(rows, width, dtype, DEVICE, seed + 1, 4.0)
    w, w2 = (_data(1, width, dtype, DEVICE, seed + i)[0] for i in (2, 3))
    logits = _data(min(rows, 64), vocab, torch.float32, DEVICE, seed + 4, 5.0)
    r = seed % rows
    outputs = {
        "rms": (exact_rows.rms_norm, (x, w, 1e-6)),
        "add_then_norm": (exact_rows.add_rms_norm_then_norm, (h, x, w, w2, 1e-6)),
        "silu_mul": (exact_rows.silu_mul, (h, x)),
        "log_softmax": (exact_rows.log_softmax, (logits,)),
    }
    for name, (fn, args) in outputs.items():
        full, alone = (
            fn(*args),
            fn(*(a[r % a.shape[0] : r % a.shape[0] + 1] if torch.is_tensor(a) and a.dim() == 2 else a for a in args)),
        )
        for f, a in zip(
            full if isinstance(full, tuple) else (full,), alone if isinstance(alone, tuple) else (alone,), strict=True
        ):
            assert torch.equal(f[r % f.shape[0] : r % f.shape[0] + 1], a), f"{name}: row {r} of {rows} changed alone"
    _close(exact_rows.rms_norm(x, w, 1e-6), _rms_reference(x, w), dtype, f"rms_norm {rows}x{width}", scale=4)
    err = (exact_rows.log_softmax(logits).double() - torch.log_softmax(logits.double(), -1)).abs().max().item()
    assert err < 1e-5, f"log_softmax {vocab}: max error {err}"
    heads, half = 2, 8
    q, kk = (_data(rows, heads * 2 * half, dtype, DEVICE, seed + i).view(rows, 1, heads, 2 * half) for i in (5, 6))
    angle = torch.arange(rows, dtype=torch.float32)[:, None] * torch.rand(2 * half, generator=_generator(seed))
    cos, sin = (f(angle).to(DEVICE, dtype)[:, None, :] for f in (torch.cos, torch.sin))
    if exact_rows.rotary_supported(q):
        full = exact_rows.rotary(q, kk, cos, sin)
        alone = exact_rows.rotary(q[r : r + 1], kk[r : r + 1], cos[r : r + 1], sin[r : r + 1])
        assert all(torch.equal(f[r : r + 1], a) for f, a in zip(full, alone, strict=True)), f"rotary row {r}"


@SETTINGS
@given(
    b=st.integers(1, 64),
    n=st.one_of(st.sampled_from([1, 1023, 1024, 1025]), st.integers(1, 60000)),
    seed=st.integers(0, 2**62),
)
def check_uniform(b, n, seed) -> None:
    """The sampling uniforms' kernel: the torch reference's bits at any batch and vocabulary."""
    from ouro_cli.engine.request_rng import torch_uniform
    from ouro_cli.kernels.uniform import uniform

    keys = torch.randint(-(2**62), 2**62, (b,), generator=_generator(seed % 2**31), dtype=torch.long).to(DEVICE)
    assert torch.equal(uniform(keys, n), torch_uniform(keys, n)), f"B {b} n {n}"


@settings(SETTINGS, max_examples=EXAMPLES * 3)  # an example takes a fraction of a second
@given(
    rows=st.integers(1, 70),
    heads=st.integers(1, 4),
    d=st.sampled_from([16, 64, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    low=st.integers(-130, 100),
    seed=st.integers(0, 2**16),
)
@example(rows=70, heads=1, d=128, dtype=torch.bfloat16, low=-130, seed=0)  # fp32 subnormals to 2^100
@example(rows=4, heads=2, d=16, dtype=torch.float32, low=-130, seed=1)
def check_fp8_rows(rows, heads, d, dtype, low, seed) -> None:
    """kernels/fp8_rows.py: the round trip of rows [rows, heads, D] of magnitudes 2^low ..
    2^100, zero rows, ties of the e4m3 rounding and values that scale onto 448
    (_decode_kernel_checks.fp8_rows_data) has the bits of kv_quant's torch round trip; and the
    packed rows the decode kernel writes for up to 8 of them (write_kv_and_attend, plane 0; a
    program a row and head, slow under the interpreter) are kv_quant.pack's bytes."""
    from ouro_cli.kernels import fp8_rows
    from ouro_cli.kernels.decode_attention import write_kv_and_attend
    from ouro_cli.model import kv_quant
    from tests.unit.engine._decode_kernel_checks import fp8_rows_data, same_bits

    x = fp8_rows_data(rows * heads, d, seed, (low, 100)).view(rows, heads, d).to(dtype).to(DEVICE)
    assert same_bits(fp8_rows.round_trip(x, kv_quant.LOWEST_EXPONENT), kv_quant.torch_round_trip(x)), (
        f"{rows}x{heads}x{d} {dtype} 2^{low}"
    )
    x = x[: rows if CUDA else 8]
    rows = x.shape[0]
    planes = [torch.zeros(heads, rows + 1, kv_quant.row_bytes(d, 1, True), dtype=torch.uint8, device=DEVICE)]
    planes.append(planes[0].clone())
    slots = torch.randperm(rows, generator=_generator(seed)).to(DEVICE)
    ctx, lens = slots[:, None], torch.ones(rows, dtype=torch.long, device=DEVICE)  # each row reads its new slot
    q = torch.ones(rows, heads, d, dtype=dtype, device=DEVICE)
    active = torch.ones(rows, dtype=torch.bool, device=DEVICE)
    write_kv_and_attend(q, *planes, None, None, slots, x, x.flip(0), active, ctx, lens)
    for plane, values in zip(planes, (x, x.flip(0)), strict=True):
        want = kv_quant.pack(values.cpu()).transpose(0, 1)
        assert torch.equal(plane[:, slots].cpu(), want), f"packed rows {rows}x{heads}x{d} {dtype} 2^{low}"


CHECKS = {
    "decode_attention": check_decode_attention,
    "replay_attention": check_replay_attention,
    "fixed_tile": check_fixed_tile,
    "gemv": check_gemv,
    "row_kernels": check_row_kernels,
    "uniform": check_uniform,
    "fp8_rows": check_fp8_rows,
}

if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
