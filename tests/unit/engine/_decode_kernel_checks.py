"""Checks of the Triton decode kernels (ouro_cli/kernels), shared by the CPU tests
(run here as a script under the Triton interpreter, in a process of its own) and the
GPU tests (imported, on CUDA).

Why a subprocess on CPU: TRITON_INTERPRET is read when a kernel is decorated, i.e. when
the kernel module is first imported, so setting it inside pytest would turn the kernels
of every later test in that process (the GPU ones included) into interpreted ones.

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/unit/engine/_decode_kernel_checks.py [attention ...]
"""

from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl

from ouro_cli.engine.kv_cache import PagedKVCache
from ouro_cli.engine.paged_attention import decode_attention
from ouro_cli.kernels.decode_attention import _e4m3_values
from tests.unit.engine._interpreted import run_checks

# (B, Hq, Hkv, D, lengths, tile): MHA and GQA, a group of 3, head_dim not a power of two,
# length 1, lengths on and off tile boundaries, the default tile (None)
ATTENTION_CASES = [
    (1, 4, 4, 16, [1], 16),
    (3, 8, 2, 32, [1, 17, 40], 16),
    (4, 6, 2, 24, [5, 33, 64, 7], 32),
    (2, 2, 1, 16, [65, 130], None),
    (5, 4, 4, 16, [3, 1, 16, 48, 20], 16),
]


def _block(tile):
    return {} if tile is None else {"block": tile}


def paged_context(b: int, hkv: int, d: int, lengths: list[int], width: int, dtype, device, seed: int = 0):
    """Random planes [Hkv, slots, D] and a slot table [B, width] holding each row's distinct,
    randomly permuted slots, then the scratch slot (the last one), as kv.slot_table builds it."""
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(lengths) + 7
    k_plane = torch.randn(hkv, num_slots + 1, d, generator=g).to(device, dtype)
    v_plane = torch.randn(hkv, num_slots + 1, d, generator=g).to(device, dtype)
    perm = torch.randperm(num_slots, generator=g)
    ctx = torch.full((b, width), num_slots, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    used = 0
    for row, n in enumerate(lengths):
        ctx[row, :n] = perm[used : used + n]
        valid[row, :n] = True
        used += n
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    return k_plane, v_plane, ctx.to(device), valid.to(device), lengths_t.to(device)


def dense_reference(q, k_plane, v_plane, ctx, lengths) -> torch.Tensor:
    """Plain per-row fp64 softmax attention over the row's first `length` slots."""
    b, hq, d = q.shape
    g = hq // k_plane.shape[0]
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for row in range(b):
        slots = ctx[row, : int(lengths[row])].cpu()
        for h in range(hq):
            k = k_plane[h // g].cpu().double()[slots]
            v = v_plane[h // g].cpu().double()[slots]
            w = torch.softmax(k @ q[row, h].cpu().double() * d**-0.5, dim=0)
            out[row, h] = w @ v
    return out


def check_attention(device="cpu", dtype=torch.float32, tol=1e-5) -> None:
    """The kernel equals the torch reference (and a dense fp64 one) to `tol`."""
    from ouro_cli.kernels.decode_attention import paged_decode_attention

    for case, (b, hq, hkv, d, lengths, tile) in enumerate(ATTENTION_CASES):
        width = -(-max(lengths) // 64) * 64
        k_plane, v_plane, ctx, valid, lens = paged_context(b, hkv, d, lengths, width, dtype, device, seed=case)
        q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(100 + case)).to(device, dtype)
        got = paged_decode_attention(q, k_plane, v_plane, ctx, lens, **_block(tile))
        assert got.shape == q.shape and got.dtype == dtype
        ref = decode_attention(q, k_plane, v_plane, ctx, valid, 64)
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= tol, f"case {case}: kernel vs decode_attention {err:.3g} > {tol}"
        dense_err = (got.double().cpu() - dense_reference(q, k_plane, v_plane, ctx, lens)).abs().max().item()
        assert dense_err <= tol, f"case {case}: kernel vs dense fp64 {dense_err:.3g} > {tol}"


def check_fp8_attention(device="cpu") -> None:
    """Over packed fp8 planes (model/kv_quant.py) the kernel computes, bit for bit, what it
    computes over the same planes unpacked into the query's dtype (fp32 and bf16: the unpacked
    values are exact in both), and equals the torch reference over the packed planes to 1e-5
    (fp32); the planes hold values of very different sizes, so every token has its own scale.
    The default mode applies the scales outside the dots, exact mode dequantizes as it loads: in
    exact mode the bits hold also for value rows below 2^-100, where a softmax weight times its
    row's scale leaves fp32's normal range (`_fp8_sizes`)."""
    from ouro_cli.kernels.decode_attention import paged_decode_attention
    from ouro_cli.model import kv_quant
    from ouro_cli.settings import ExecutionSettings, executing

    for case, (b, hq, hkv, d, lengths, tile) in enumerate(ATTENTION_CASES):
        width = -(-max(lengths) // 64) * 64
        k_plane, v_plane, ctx, valid, lens = paged_context(b, hkv, d, lengths, width, torch.float32, "cpu", seed=case)
        ctx, valid, lens = (t.to(device) for t in (ctx, valid, lens))  # the planes are scaled on the host first
        for exact, tiny in ((False, False), (True, False), (True, True)):
            k_sizes, v_sizes = (_fp8_sizes(k_plane.shape[1], tiny and which == "v", case) for which in "kv")
            scaled = (k_plane * k_sizes, v_plane * v_sizes)
            packed = [kv_quant.torch_pack(x).to(device) for x in scaled]  # kv_quant.pack's bytes (fp8_round_trip)
            for dtype in (torch.float32, torch.bfloat16):
                q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(100 + case)).to(device, dtype)
                with executing(ExecutionSettings(exact=exact)):
                    got = paged_decode_attention(q, *packed, ctx, lens, **_block(tile))
                    unpacked = [kv_quant.unpack(x, dtype, d) for x in packed]
                    apart = paged_decode_attention(q, *unpacked, ctx, lens, **_block(tile))
                assert torch.equal(got, apart), (case, exact, tiny, dtype)
                if dtype == torch.float32 and not tiny:
                    ref = decode_attention(q, *packed, ctx, valid, 64)
                    err = (got - ref).abs().max().item()
                    assert err <= 1e-5 * ref.abs().max().item(), f"case {case}: kernel vs decode_attention {err:.3g}"


def check_fp8_twice_the_codes(device="cpu") -> None:
    """Packed rows of codes up to 224 at 2^k, and the same values as twice the codes at 2^(k-1)
    (how the engine's fused write packs a row whose largest value its rounding put on a binade
    edge: model/layers.py `Attend`): the kernel gives the same bits over either, in the default
    mode (scales outside the dots) and exact mode, fp32 and bf16, at every exponent k in
    -20 .. 20."""
    from ouro_cli.kernels.decode_attention import paged_decode_attention
    from ouro_cli.model import kv_quant
    from ouro_cli.settings import ExecutionSettings, executing

    for case, (b, hq, hkv, d, lengths, tile) in enumerate(ATTENTION_CASES):
        width = -(-max(lengths) // 64) * 64
        k_plane, _, ctx, _, lens = paged_context(b, hkv, d, lengths, width, torch.float32, device, seed=case)
        g = torch.Generator().manual_seed(case)
        halves, twice = [], []
        for _ in "kv":  # codes 0 .. 118 (e4m3 0 .. 224), signs drawn; one exponent a token and head
            rows = torch.zeros(*k_plane.shape[:2], kv_quant.row_bytes(d, 1, True), dtype=torch.uint8)
            sign = (torch.rand(*k_plane.shape, generator=g) < 0.5).to(torch.uint8) << 7
            rows[..., :d] = torch.randint(0, 119, k_plane.shape, generator=g, dtype=torch.uint8) | sign
            k = torch.randint(-20, 21, k_plane.shape[:2], generator=g, dtype=torch.int8)
            rows[..., d] = k.view(torch.uint8)
            doubled = rows.clone()
            values = rows[..., :d].view(torch.float8_e4m3fn).double() * 2  # exact: at most 448
            doubled[..., :d] = values.to(torch.float8_e4m3fn).view(torch.uint8)
            doubled[..., d] = (k - 1).view(torch.uint8)
            for dtype in (torch.float32, torch.bfloat16):
                assert torch.equal(kv_quant.unpack(rows, dtype, d), kv_quant.unpack(doubled, dtype, d))
            halves.append(rows.to(device))
            twice.append(doubled.to(device))
        for exact in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(200 + case)).to(device, dtype)
                with executing(ExecutionSettings(exact=exact)):
                    got = paged_decode_attention(q, *halves, ctx, lens, **_block(tile))
                    other = paged_decode_attention(q, *twice, ctx, lens, **_block(tile))
                assert same_bits(got, other), (case, exact, dtype)


def _fp8_sizes(slots: int, tiny: bool, seed: int) -> torch.Tensor:
    """Per-token sizes [1, slots, 1] for a plane of unit normals: 10^-3 .. 10^3 in a random order,
    or with `tiny` 2^-120 .. 2^-100, where a softmax weight below 2^-6 times the row's scale
    (2^k, k below -120) underflows fp32's normal range."""
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))
    sizes = torch.logspace(-120, -100, slots, base=2.0) if tiny else torch.logspace(-3, 3, slots)
    return sizes[order][None, :, None]


# e4m3's 127 non-negative finite values, ascending (codes 0x00 .. 0x7E: 0 .. 448)
E4M3_VALUES = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def fp8_rows_data(rows: int, d: int, seed: int, exponents: tuple[int, int] = (-130, 100)) -> torch.Tensor:
    """fp64 rows [rows, d] for the fp8 rounding, in turn: random normals times 2^e (e drawn from
    `exponents`: fp32 subnormals at -130); a row of zeros, with a -0.0; a row whose largest |x|
    is 448 · 2^j (k = j, x / 2^k lands on e4m3's largest value) and whose other elements lie
    halfway between neighbouring e4m3 values times 2^j (ties, to even), signs drawn; and a row
    of e4m3 values times 2^j (exact after scaling) led by 432 · 2^j or 440 · 2^j, which round up
    to 448 (a tie and a nearest)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = exponents
    out = torch.empty(rows, d, dtype=torch.float64)
    for r in range(rows):
        kind = r % 4
        j = int(torch.randint(min(lo, hi - 9), hi - 8, (1,), generator=g))  # 448 · 2^j <= 2^hi
        signs = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0).double()
        codes = torch.randint(0, 126, (d,), generator=g)
        if kind == 0:
            e = int(torch.randint(lo, hi + 1, (1,), generator=g))
            out[r] = torch.randn(d, generator=g, dtype=torch.float64) * 2.0**e
        elif kind == 1:
            out[r] = 0.0
            out[r, int(torch.randint(0, d, (1,), generator=g))] = -0.0
        elif kind == 2:
            out[r] = signs * (E4M3_VALUES[codes] + E4M3_VALUES[codes + 1]) / 2 * 2.0**j
            out[r, int(torch.randint(0, d, (1,), generator=g))] = 448.0 * 2.0**j
        else:
            out[r] = signs * E4M3_VALUES[codes] * 2.0**j
            out[r, int(torch.randint(0, d, (1,), generator=g))] = (432.0 if r % 8 == 3 else 440.0) * 2.0**j
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (-0.0 is not 0.0)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints).cpu(), b.view(ints).cpu())


@triton.jit
def _convert_codes(CODES, OUT, ROWS: tl.constexpr, COLS: tl.constexpr):
    at = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(OUT + at, _e4m3_values(tl.load(CODES + at), OUT.dtype.element_ty))


def check_e4m3_values(device="cpu") -> None:
    """The decode kernels' conversion of e4m3 codes (decode_attention._e4m3_values) gives torch's
    values bit for bit, to bf16 and fp32, for every finite code, each at about 32 random places of
    a tile."""
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    order = torch.randperm(64 * 128, generator=torch.Generator().manual_seed(0)) % finite.numel()
    codes = finite[order].view(64, 128).to(device)
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(64, 128, dtype=dtype, device=device)
        _convert_codes[(1,)](codes, out, ROWS=64, COLS=128)
        want = codes.view(torch.float8_e4m3fn).to(dtype)
        assert same_bits(out, want), (dtype, (out != want).nonzero()[:4].tolist())


def check_fp8_round_trip(
    device="cpu", shape=(70, 3, 64), dtypes=(torch.float32, torch.bfloat16, torch.float16)
) -> None:
    """kernels/fp8_rows.round_trip of `fp8_rows_data` rows [N, H, D] (a head view of a wider
    projection, as a layer's v is; fp16 within its range) has the bits of kv_quant's torch round
    trip, on the device and on the CPU; `kv_quant.round_trip` without a gradient runs it (with
    one: the torch code); fp8_rows.pack has kv_quant's torch bytes (`torch_pack`), and
    `kv_quant.pack` runs it; and the rows packed as they are hold the values of their round trip
    (the engine's fused write takes a layer's K/V unrounded: model/layers.py `Attend`)."""
    from ouro_cli.kernels import fp8_rows
    from ouro_cli.model import kv_quant

    n, h, d = shape
    for i, dtype in enumerate(dtypes):
        exponents = (-30, 12) if dtype == torch.float16 else (-130, 100)
        x = fp8_rows_data(n * h, d, seed=i, exponents=exponents).view(n, h, d)
        wide = torch.zeros(n, h * d + 16, dtype=dtype)
        wide[:, 8 : 8 + h * d] = x.reshape(n, h * d).to(dtype)
        x = wide.to(device)[:, 8 : 8 + h * d].view(n, h, d)
        got = fp8_rows.round_trip(x, kv_quant.LOWEST_EXPONENT)
        assert same_bits(got, kv_quant.torch_round_trip(x)), (dtype, "device torch")
        assert same_bits(got, kv_quant.torch_round_trip(x.cpu())), (dtype, "cpu torch")
        with torch.no_grad():
            assert same_bits(kv_quant.round_trip(x), got)
        assert same_bits(fp8_rows.round_trip(x[0, 0], kv_quant.LOWEST_EXPONENT), got[0, 0]), "a 1-d row"
        packed = kv_quant.pack(x)
        assert packed.shape == (n, h, kv_quant.row_bytes(d, 1, True)) and packed.dtype == torch.uint8
        assert torch.equal(packed, kv_quant.torch_pack(x)), (dtype, "pack, device torch")
        assert torch.equal(packed.cpu(), kv_quant.torch_pack(x.cpu())), (dtype, "pack, cpu torch")
        assert torch.equal(kv_quant.pack(x[0, 0]), packed[0, 0]), "a 1-d row, packed"
        # packed as they are (unrounded), as the engine's fused write packs a layer's K/V
        assert torch.equal(kv_quant.unpack(packed, dtype, d), got), "packed rows unpack to the round trip"
        grad = x.clone().requires_grad_()
        out = kv_quant.round_trip(grad)
        assert out.grad_fn is not None and same_bits(out.detach(), got), "the straight-through path"


def check_batch_invariance(device="cpu", dtype=torch.float32) -> None:
    """A row's output is the same bits alone (narrow slot table) or among longer rows (wide table)."""
    from ouro_cli.kernels.decode_attention import paged_decode_attention

    hq, hkv, d = 8, 2, 32
    lengths = [150, 37, 1, 300, 64]
    k_plane, v_plane, ctx, _, lens = paged_context(len(lengths), hkv, d, lengths, 384, dtype, device)
    q = torch.randn(len(lengths), hq, d, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    together = paged_decode_attention(q, k_plane, v_plane, ctx, lens)
    for row, n in enumerate(lengths):
        width = -(-n // 64) * 64
        alone = paged_decode_attention(
            q[row : row + 1], k_plane, v_plane, ctx[row : row + 1, :width].contiguous(), lens[row : row + 1]
        )
        assert torch.equal(alone[0], together[row]), f"row {row} (length {n}) changed with its batch-mates"
    # the same rows in another order and with padding rows after them
    order = [3, 1, 4, 0, 2]
    pad = 3
    q2 = torch.cat([q[order], q[:pad]])
    ctx2 = torch.cat([ctx[order], ctx[:pad]])
    lens2 = torch.cat([lens[order], torch.ones(pad, dtype=lens.dtype, device=device)])
    shuffled = paged_decode_attention(q2, k_plane, v_plane, ctx2, lens2)
    assert torch.equal(shuffled[: len(order)], together[order])


def check_write_and_attend(device="cpu", dtype=torch.float32, fp8=False) -> None:
    """The fused write-and-attend kernel leaves plane t of the engine's cache exactly as runner.py's
    torch write does (active rows write new K/V at their slot, exited rows copy plane t-1; plane
    0: always new), and its output is, bit for bit, the attention kernel's over those planes.

    With `fp8` the planes hold packed rows: an active row writes kv_quant.pack's bytes of its
    new K/V (the layer's rounded values, or any: the kernel quantizes them), an exited row
    copies plane t-1's whole row, padding included; the new rows hold zeros, ties of the
    rounding, fp32 subnormals and values that scale onto 448 (`fp8_rows_data`)."""
    from ouro_cli.kernels.decode_attention import paged_decode_attention, write_kv_and_attend
    from ouro_cli.model import kv_quant

    g = torch.Generator().manual_seed(3)
    b, hq, hkv, d, layers, loops = 6, 4, 2, 24, 2, 3
    kv = PagedKVCache(
        num_layers=layers,
        num_loops=loops,
        num_blocks=16,
        block_size=4,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
        device=device,
        fp8=fp8,
    )
    perm = torch.randperm(16 * 4, generator=g)
    slots, others = perm[:b].to(device), perm[b:]
    active = torch.tensor([True, False, True, False, False, True], device=device)
    lengths = [1, 17, 33, 2, 40, 9]  # each row's new slot is its last position; the rest read-only slots
    ctx = torch.zeros(b, 48, dtype=torch.long)
    for row, n in enumerate(lengths):
        ctx[row, : n - 1] = others[torch.randperm(len(others), generator=g)[: n - 1]]
        ctx[row, n - 1 :] = slots[row]
    ctx, lens = ctx.to(device), torch.tensor(lengths, device=device)
    q = torch.randn(b, hq, d, generator=g).to(device, dtype)
    if fp8:  # the attention's scores stay finite below 2^60
        k_new, v_new = (fp8_rows_data(b * hkv, d, seed, (-130, 60)).view(b, hkv, d) for seed in (1, 2))
        k_new = kv_quant.torch_round_trip(k_new.to(dtype))  # as the layer hands it over
        v_new = v_new.to(dtype)[:, None]  # unrounded: the kernel rounds as pack does
    else:
        k_new = torch.randn(b, hkv, d, generator=g).to(dtype)
        v_new = torch.randn(b, 1, hkv, d, generator=g).to(dtype)
    k_new, v_new = k_new.to(device), v_new.to(device)[:, 0]  # v: a strided view, as in the runner

    def fill(plane: torch.Tensor) -> None:  # plane t-1 at the slots differs from k_new
        values = torch.randn(*plane.shape[:-1], d, generator=g, dtype=torch.float64)
        if fp8:  # packed rows of very different sizes (every token its own scale), padding random
            sizes = 2.0 ** torch.randint(-20, 20, plane.shape[:-1] + (1,), generator=g)
            values = kv_quant.torch_pack((values * sizes).to(dtype))
            values[..., d + 1 :] = torch.randint(0, 256, values[..., d + 1 :].shape, generator=g, dtype=torch.uint8)
        plane.copy_(values)

    new_rows = [kv_quant.pack(x) if fp8 else x for x in (k_new, v_new)]  # what an active row writes
    for layer in range(layers):
        for plane in range(loops):
            fill(kv.k)
            fill(kv.v)
            ref_k, ref_v = kv.k.clone(), kv.v.clone()
            rows = new_rows
            if plane > 0:
                keep = active[:, None, None]
                rows = [
                    torch.where(keep, x, p[layer, plane - 1][:, slots].transpose(0, 1))
                    for x, p in zip(rows, (ref_k, ref_v), strict=True)
                ]
            ref_k[layer, plane].index_copy_(1, slots, rows[0].transpose(0, 1))
            ref_v[layer, plane].index_copy_(1, slots, rows[1].transpose(0, 1))
            prev = kv.plane(layer, plane - 1) if plane > 0 else (None, None)
            out = write_kv_and_attend(
                q, *kv.plane(layer, plane), *prev, slots, k_new, v_new, active, ctx, lens, block=16
            )
            assert torch.equal(kv.k, ref_k) and torch.equal(kv.v, ref_v), (layer, plane)
            apart = paged_decode_attention(q, ref_k[layer, plane], ref_v[layer, plane], ctx, lens, block=16)
            assert same_bits(out, apart), (layer, plane)


@functools.cache
def _engine_run(device: str, attention: str, gemv: str) -> tuple[torch.nn.Module, list]:
    """(the tiny model, its engine's outputs) for three requests of 4 tokens with threshold exits,
    fp32, the decode step's attention and projections on `attention` and `gemv`. Run once per
    process: check_engine and check_replay_mode_engine read the same run."""
    from ouro_cli.engine import LLM, SamplingParams
    from ouro_cli.settings import ExecutionSettings
    from tests.unit.engine.conftest import prompts, tiny_model

    params = [SamplingParams(max_tokens=4, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True) for s in range(3)]
    model = tiny_model(0).to(device)
    llm = LLM(
        model,
        max_num_seqs=3,
        kv_blocks=16,
        block_size=4,
        cuda_graphs=False,
        execution=ExecutionSettings(decode_attention=attention, decode_gemv=gemv),
    )
    try:
        assert llm.runner.attention == attention and (llm.runner.gemv is None) == (gemv == "cublas")
        return model, llm.generate(prompts(3, seed=1), params)  # prefill runs the replay path (sdpa here)
    finally:
        llm.close()


def check_engine(device="cpu") -> None:
    """The engine with attention="triton", and then also the projections on the small-batch
    matmul (gemv="triton"), reports the torch path's logprobs (fp32) and still equals the
    trainer's replay; exits are mixed so the carry-forward path runs."""
    from ouro_cli.settings import ExecutionSettings
    from tests.unit.engine.test_replay import max_replay_error

    _, reference = _engine_run(device, "torch", "cublas")
    for gemv in ("cublas", "triton"):
        model, out = _engine_run(device, "triton", gemv)
        assert len({d for o in out for d in o.exit_depths[1:]}) >= 2
        for a, b in zip(reference, out, strict=True):
            assert a.output_token_ids == b.output_token_ids and a.exit_depths == b.exit_depths
            assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) <= 1e-5
        model.execution = ExecutionSettings()
        assert max_replay_error(model, out, 1.0) <= 1e-5


def check_engine_fp8(device="cpu") -> None:
    """An fp8 KV cache under the Triton attention (fp32, default mode): the prefill's layers round
    K/V in kernels/fp8_rows.py and the decode kernel writes the packed rows itself (every decode
    layer-loop goes through write_kv_and_attend on uint8 planes), from the decode layers' K/V
    unrounded, with the outputs, bit for bit, of the same engine whose decode layers round them
    first (`attend_packs_kv` off: more round trips); exits are mixed, so exited
    rows copy their packed rows forward; and the engine agrees with the trainer's replay as
    test_replay.py's fp8 test finds (3 tokens in 4 within 1e-5 at least: the others may follow an
    element that the two sides' last-bit differences rounded apart; an exited row that wrote its
    new K/V instead of copying its plane misses a third of these 15), while a replay that does not
    round misses the median token by more than 1e-3."""
    from ouro_cli.engine import LLM, SamplingParams
    from ouro_cli.kernels import decode_attention
    from ouro_cli.settings import ExecutionSettings
    from tests.unit.engine.conftest import prompts, tiny_model
    from tests.unit.engine.test_replay import replay_logprobs

    params = [SamplingParams(max_tokens=5, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True) for s in range(3)]
    model = tiny_model(0).to(device)
    model.execution = ExecutionSettings(kv_cache_dtype="fp8", decode_attention="triton")
    planes, fused = [], decode_attention.write_kv_and_attend

    def spy(q, k_plane, *args, **kwargs):
        planes.append(k_plane.dtype)
        return fused(q, k_plane, *args, **kwargs)

    from ouro_cli.model import kv_quant

    round_trip, trips = kv_quant.round_trip, []

    def counted(x):
        trips.append(x.shape)
        return round_trip(x)

    runs = {}
    decode_attention.write_kv_and_attend, kv_quant.round_trip = spy, counted
    try:
        for packs in (True, False):
            llm = LLM(model, max_num_seqs=3, kv_blocks=16, block_size=4, cuda_graphs=False)
            llm.runner.attend_packs_kv = packs
            assert llm.runner.attention == "triton" and llm.runner.kv.fp8
            trips.clear()
            runs[packs] = (llm.generate(prompts(3, seed=1), params), len(trips))
            llm.close()
    finally:
        decode_attention.write_kv_and_attend, kv_quant.round_trip = fused, round_trip
    assert planes and set(planes) == {torch.uint8}, planes
    (outs, packed_trips), (layer_rounded, rounded_trips) = runs[True], runs[False]
    assert packed_trips < rounded_trips, (packed_trips, rounded_trips)  # no round trip in the decode layers
    for a, b in zip(outs, layer_rounded, strict=True):
        assert a.output_token_ids == b.output_token_ids and a.exit_depths == b.exit_depths
        assert same_bits(torch.tensor(a.log_probs), torch.tensor(b.log_probs))
    assert len({d for o in outs for d in o.exit_depths[1:]}) >= 2

    def errors() -> torch.Tensor:
        return torch.cat([(torch.tensor(o.log_probs) - replay_logprobs(model, o, 1.0)).abs() for o in outs])

    rounded = errors()
    model.execution = ExecutionSettings()
    unrounded = errors()
    assert rounded.quantile(0.75) <= 1e-5 and unrounded.median() > 1e-3, (rounded, unrounded)


def _packed_layout(device):
    """Rows with packed documents, left and right padding: SequenceLayout's mask."""
    from ouro_cli.model.attention import SequenceLayout

    ids = torch.zeros(3, 21, dtype=torch.long)
    valid = torch.ones(3, 21, dtype=torch.long)
    valid[1, :4] = 0  # left padding
    valid[2, 17:] = 0  # right padding
    docs = torch.tensor([[0] * 21, [0] * 9 + [1] * 12, [0] * 5 + [1] * 1 + [2] * 15])
    return SequenceLayout.build(ids.to(device), valid.to(device), docs.to(device))


def _check_replay_forward(q, k, v, tol) -> None:
    """`check_replay_attention`'s forward checks at one head layout: SDPA to `tol`, and the
    queries' bits those of the decode kernel alone, for all queries and for some."""
    from ouro_cli.kernels.decode_attention import paged_decode_attention
    from ouro_cli.kernels.replay_attention import paged_forward, visible_runs
    from ouro_cli.model.attention import sdpa_attention

    b, s, hq, d = q.shape
    for mask in (_packed_layout(q.device).mask, None):
        out = paged_forward(q, k, v, mask)
        assert (out.double() - sdpa_attention(q, k, v, mask).double()).abs().max() <= tol
        start, length = visible_runs(mask, b, s, q.device)
        # every query of the row with three documents (programs cut at each start and every 16 / G
        # queries), and the other rows' first, middle and last
        for row, i in [(2, i) for i in range(s)] + [(r, i) for r in range(b - 1) for i in (0, 8, 15, 20)]:
            lo, n = int(start[row, i]), int(length[row, i])
            planes = [x[row, lo : lo + n].transpose(0, 1).contiguous() for x in (k, v)]
            ctx = torch.arange(n + 5, device=q.device).clamp(max=n - 1)[None]  # another table width
            alone = paged_decode_attention(q[row, i][None], *planes, ctx, torch.tensor([n], device=q.device))
            assert torch.equal(alone[0], out[row, i]), (hq, row, i)
        # a loop that only some positions run gives the kernel their queries alone: the same bits
        rows = torch.tensor([0, 3, 4, 5, 20, 21 + 7, 21 + 8, 2 * 21 + 5, 2 * 21 + 16], device=q.device)
        some = paged_forward(q.reshape(b * s, hq, d)[rows][None], k, v, mask, rows)
        assert torch.equal(some[0], out.reshape(b * s, hq, d)[rows])


def check_replay_attention(device="cpu", dtype=torch.float32, tol=1e-5) -> None:
    """`replay_attention="paged"` (kernels/replay_attention.py): equals SDPA to `tol` under
    packed, padded and plain causal layouts; every query's output is bitwise the decode
    kernel's for that query alone over its context, with several queries of a run to a
    program (G = 2 and G = 1 heads per kv head), and the same when only some queries are
    given (`rows`); gradients are SDPA's, bit for bit, for all queries and for some; a mask
    that is not a contiguous run is refused."""
    from ouro_cli.kernels.replay_attention import (
        paged_forward,
        paged_replay_attention,
        program_blocks,
    )
    from ouro_cli.model.attention import QueryRows, sdpa_attention, sdpa_attention_at_rows

    keys = torch.tensor([0, 0, 0, 5, 5, 7, 7, 7, 7, 7], device=device)
    first, count = program_blocks(keys, 2)  # a new run starts a program; a run is cut every 2 queries
    assert first.tolist() == [0, 2, 3, 5, 7, 9] and count.tolist() == [2, 1, 2, 2, 2, 1]
    g = torch.Generator().manual_seed(5)
    b, s, hq, hkv, d = 3, 21, 4, 2, 16
    k, v = (torch.randn(b, s, hkv, d, generator=g).to(device, dtype) for _ in range(2))
    for heads in (hkv, hq):  # G = 1 (Ouro's: 16 queries a program) and G = 2 (8)
        q = torch.randn(b, s, heads, d, generator=g).to(device, dtype)
        _check_replay_forward(q, k, v, tol)
    mask = _packed_layout(device).mask
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    grad_out = torch.randn(b, s, hq, d, generator=g).to(device, dtype)
    got = torch.autograd.grad(paged_replay_attention(*leaves, mask, sdpa_attention), leaves, grad_out)
    want = torch.autograd.grad(sdpa_attention(*ref_leaves, mask), ref_leaves, grad_out)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    # the queries of some positions only (model/attention.py attention_at_rows): SDPA's gradients too
    queries = QueryRows.build(torch.rand(b, s, generator=g).to(device) < 0.5, mask)
    q_rows = q.reshape(b * s, hq, d)[queries.rows][None]
    leaves = [x.clone().requires_grad_() for x in (q_rows, k, v)]
    ref_leaves = [x.clone().requires_grad_() for x in (q_rows, k, v)]
    grad_out = torch.randn(q_rows.shape, generator=g).to(device, dtype)

    def at_rows(q, k, v, _mask=None):
        return sdpa_attention_at_rows(q, k, v, queries.slots, queries.mask, queries.slot_inverse)

    out = paged_replay_attention(*leaves, mask, at_rows, rows=queries.rows)
    assert (out.double() - at_rows(*ref_leaves).double()).abs().max() <= tol
    got = torch.autograd.grad(out, leaves, grad_out)
    want = torch.autograd.grad(at_rows(*ref_leaves), ref_leaves, grad_out)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    holes = mask.clone()
    holes[0, 0, 10, 3] = False  # a gap inside a query's run
    try:
        paged_forward(q, k, v, holes)
    except ValueError:
        pass
    else:
        raise AssertionError("a non-contiguous mask was accepted")


def check_fp8_replay(device="cpu", b=2, s=24, heads=2, d=128) -> None:
    """With an fp8 cache the replay (kernels/replay_attention.py) gives every query the bits the
    decode kernel gives it over the engine's packed cache: K/V rounded as a layer rounds them
    (kv_quant.round_trip), at Ouro's head_dim of 128 (G = 1), in the default mode and in exact
    mode, bf16. The check compares against the packed planes, as a decode step reads them, not
    the values unpacked: the kernel is compiled differently for the two. (Random rows do not
    show a difference between them on a GPU; tests/gpu/test_exact_train_gpu.py's fp8 variants
    are the end-to-end check that does.)"""
    from ouro_cli.kernels.decode_attention import paged_decode_attention
    from ouro_cli.kernels.replay_attention import paged_forward
    from ouro_cli.model import kv_quant
    from ouro_cli.settings import ExecutionSettings, executing

    g = torch.Generator().manual_seed(11)
    sizes = torch.logspace(-2, 2, b * s)[torch.randperm(b * s, generator=g)].reshape(b, s, 1, 1)
    k, v = (kv_quant.torch_round_trip((torch.randn(b, s, heads, d, generator=g) * sizes).bfloat16()) for _ in "kv")
    q = (3 * torch.randn(b, s, heads, d, generator=g)).bfloat16()
    k, v, q = k.to(device), v.to(device), q.to(device)
    planes = [kv_quant.pack(x.reshape(b * s, heads, d).transpose(0, 1).contiguous()) for x in (k, v)]
    base = torch.arange(b, device=device).repeat_interleave(s)[:, None] * s  # query (r, i) reads r·s ..
    ctx = base + torch.arange(s, device=device)[None, :]
    lengths = torch.arange(1, s + 1, device=device).repeat(b)
    for exact in (False, True):
        with executing(ExecutionSettings(exact=exact, kv_cache_dtype="fp8")):
            out = paged_forward(q, k, v, None).reshape(b * s, heads, d)
            decoded = paged_decode_attention(q.reshape(b * s, heads, d), *planes, ctx, lengths)
        differ = (out != decoded).any(-1).any(-1).nonzero().flatten().tolist()
        assert not differ, f"exact={exact}: queries {differ[:10]} differ from the decode kernel's"


def check_replay_mode_engine(device="cpu") -> None:
    """The tiny model's engine (triton decode attention) against its replay with the replay's
    attention in the decode kernel's order, and with SDPA: both within 1e-5 (fp32). The engine's
    run is check_engine's with the Triton attention (`_engine_run`)."""
    from ouro_cli.settings import ExecutionSettings
    from tests.unit.engine.test_replay import max_replay_error

    model, outs = _engine_run(device, "triton", "cublas")
    errors = {}
    for mode in ("sdpa", "paged"):
        model.execution = ExecutionSettings(replay_attention=mode)
        errors[mode] = max_replay_error(model, outs, 1.0)
    print("max |Δ logprob| of the engine vs its replay, by replay attention:", errors)
    assert max(errors.values()) <= 1e-5


def check_width_from_reach(device="cpu") -> None:
    """With the Triton attention a decode step's context width covers the longest context its
    rows may reach (runner.decode's `reach`), not only the current one: a request allowed 6
    tokens decodes its first 4 on wider steps than the same request allowed 4, with the same
    tokens, depths and logprobs to the bit (the kernel walks each row's own length). The two
    reaches differ by a whole chunk of the width (`attn_chunk`), so every step of the longer
    request is wider than every step of the shorter."""
    from ouro_cli.engine import LLM, SamplingParams
    from ouro_cli.settings import ExecutionSettings
    from tests.unit.engine.conftest import prompts, tiny_model

    model = tiny_model(0).to(device)
    short, chunk = 4, 2
    runs = {}
    for max_tokens in (short, short + chunk):
        params = [
            SamplingParams(max_tokens=max_tokens, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True)
            for s in range(3)
        ]
        llm = LLM(
            model,
            max_num_seqs=3,
            kv_blocks=48,
            block_size=4,
            attn_chunk=chunk,
            cuda_graphs=False,
            execution=ExecutionSettings(decode_attention="triton"),
        )
        widths, plain = [], llm.runner._inputs

        def spy(*args, plain=plain, widths=widths):
            inputs = plain(*args)
            widths.append(inputs.width)
            return inputs

        llm.runner._inputs = spy
        try:
            outs = llm.generate(prompts(3, seed=1), params)
        finally:
            llm.close()
        runs[max_tokens] = outs, widths
    (shorter, narrow), (longer, wide) = runs[short], runs[short + chunk]
    assert min(wide) > max(narrow), (narrow, wide)
    assert len({d for o in shorter for d in o.exit_depths[1:]}) >= 2
    for a, b in zip(shorter, longer, strict=True):
        assert (a.output_token_ids, a.exit_depths, a.log_probs) == (
            b.output_token_ids[:short],
            b.exit_depths[:short],
            b.log_probs[:short],
        )


def check_replay_tables_per_forward(device="cpu") -> None:
    """The paged replay attention's tables live for one forward (model/attention.py
    `one_forward`): a forward never reads a table another forward left behind (a CUDA graph's
    capture would keep reading that memory after it is reused), and none is left after it;
    a graph's warm-up and capture share theirs, which the graph then holds (`tables_kept`)."""
    from ouro_cli.kernels import replay_attention
    from ouro_cli.settings import ExecutionSettings
    from tests.unit.engine.conftest import tiny_model

    model = tiny_model(0).to(device)
    model.execution = ExecutionSettings(replay_attention="paged")
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        want = model(ids)
        assert replay_attention._last_layout == [None, None, None] and replay_attention._last_rows[0] is None
        # a stale table of this very shape, as a graph's warm-up would leave it: every slot wrong
        replay_attention._slot_table(None, 2, 12, ids.device, 8)
        slots = replay_attention._last_layout[2][0]
        slots.fill_(0)
        assert torch.equal(model(ids), want)
        # a graph's warm-up and capture share theirs (the capture cannot build them), and the graph holds them
        from ouro_cli.model.attention import tables_kept

        with tables_kept() as kept:
            model(ids)
            built = replay_attention._last_layout[2]
            assert torch.equal(model(ids), want) and replay_attention._last_layout[2] is built
        assert kept[0] is built and replay_attention._last_layout[2] is None


def check_bounds_checks_name_the_bad_index(device="cpu") -> None:
    """OURO_CHECK_KERNELS=1 (kernels/bounds.py): a slot past the plane, a length past the slot
    table, and a program block past the queries each stop the launch with KernelIndexError."""
    import os

    from ouro_cli.kernels import bounds
    from ouro_cli.kernels.decode_attention import blocked_decode_attention, paged_decode_attention

    k_plane, v_plane, ctx, _, lengths = paged_context(3, 2, 16, [5, 9, 3], 16, torch.float32, device)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(1)).to(device)
    os.environ["OURO_CHECK_KERNELS"] = "1"
    try:
        paged_decode_attention(q, k_plane, v_plane, ctx, lengths)  # good indices pass
        cases = {
            "slot": (ctx.clone().index_fill_(1, torch.tensor([2]), k_plane.shape[1]), lengths, None),
            "positions": (ctx, lengths + 16, None),
            "program": (ctx, lengths, (torch.tensor([0, 2]), torch.tensor([2, 2]))),
        }
        for name, (table, length, blocks) in cases.items():
            try:
                if blocks is None:
                    paged_decode_attention(q, k_plane, v_plane, table, length)
                else:
                    blocked_decode_attention(q, k_plane, v_plane, table, length, *blocks)
            except bounds.KernelIndexError as err:
                assert "decode attention" in str(err), err
            else:
                raise AssertionError(f"a bad {name} index was launched")
    finally:
        del os.environ["OURO_CHECK_KERNELS"]


CHECKS = {
    "attention": check_attention,
    "fp8_attention": check_fp8_attention,
    "fp8_twice_the_codes": check_fp8_twice_the_codes,
    "fp8_round_trip": check_fp8_round_trip,
    "e4m3_values": check_e4m3_values,
    "batch_invariance": check_batch_invariance,
    "write_and_attend": check_write_and_attend,
    "write_and_attend_fp8": lambda: check_write_and_attend(fp8=True),
    "write_and_attend_fp8_bf16": lambda: check_write_and_attend(dtype=torch.bfloat16, fp8=True),
    "engine": check_engine,
    "engine_fp8": check_engine_fp8,
    "replay_attention": check_replay_attention,
    "fp8_replay": check_fp8_replay,
    "replay_mode_engine": check_replay_mode_engine,
    "width_from_reach": check_width_from_reach,
    "replay_tables_per_forward": check_replay_tables_per_forward,
    "bounds_checks": check_bounds_checks_name_the_bad_index,
}

if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
