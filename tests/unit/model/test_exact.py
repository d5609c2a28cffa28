"""Exact mode's ops (ouro_cli/model/exact.py): every row's bits are a function of that row alone.

Each op is run on batches of many sizes, in other orders and at other offsets, and a row
must come out bit for bit what it is alone; the same op must agree with torch's to
rounding (fp64 references), and its gradients must be right (gradcheck in fp64, and the
model's gradients within fp32 rounding of the default mode's). The attention's decode
form (a query over the paged KV cache) must give the bits of the replay form (the same
query inside its whole sequence, padded or packed). On CPU this is what CI checks of
exact mode; tests/gpu/test_exact_gpu.py runs the CUDA side.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ouro_cli.model import build, exact, pointwise, tiny_config
from ouro_cli.model.attention import SequenceLayout, sdpa_attention
from ouro_cli.settings import ExecutionSettings, active_settings, executing

EXACT = ExecutionSettings(exact=True)
DTYPES = [torch.float32, torch.bfloat16]
ROW_COUNTS = [1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100, 257]


def _rows(m: int, k: int, dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_rows_invariant(fn, x: torch.Tensor, what: str) -> None:
    """fn's row i is the same bits alone, in every prefix of x, in reverse and in a shuffled
    order (other places in the tiles, other tails)."""
    alone = torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
    for m in ROW_COUNTS:
        if m <= x.shape[0]:
            assert torch.equal(fn(x[:m]), alone[:m]), f"{what}: rows changed at {m} rows"
    assert torch.equal(fn(x.flip(0)).flip(0), alone), f"{what}: rows changed with their order"
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(fn(x[perm]), alone[perm]), f"{what}: rows changed when shuffled"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(64, 64), (96, 64), (64, 96), (128, 64), (200, 48), (1, 64)])
def test_linear_rows_are_bitwise_the_same_for_any_row_count(dtype, n, k):
    x, w = _rows(257, k, dtype), _rows(n, k, dtype, seed=2) / k**0.5
    _assert_rows_invariant(lambda t: exact.linear(t, w), x, f"linear N={n} K={k}")
    _assert_close(exact.linear(x, w), x.double() @ w.double().T, dtype)
    three_d = exact.linear(x[:60].view(4, 15, k), w)  # leading dims fold into rows
    assert torch.equal(three_d.view(60, n), exact.linear(x[:60], w))


def test_row_sum_is_a_fixed_tree_whatever_the_layout():
    x = torch.randn(37, 1000)
    got = exact.row_sum(x)
    assert torch.allclose(got.double(), x.double().sum(-1), atol=1e-4, rtol=0)
    for length in (1, 2, 3, 5, 64, 96, 1000):
        part = x[:, :length]
        _assert_rows_invariant(exact.row_sum, part.contiguous(), f"row_sum n={length}")
        assert torch.equal(exact.row_sum(part), exact.row_sum(part.contiguous()))  # strided rows too
    long_row = torch.randn(3, 49152)  # one long row is one thread's work in torch.sum only up to 32k elements
    assert torch.equal(exact.row_sum(long_row[:1]), exact.row_sum(long_row)[:1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_functions_are_batch_invariant_and_right(dtype):
    torch.manual_seed(0)
    h, w = 96, torch.randn(96).to(dtype)  # 96: a tail past the vector width where torch would take one
    x = (3 * torch.randn(300, h)).to(dtype)
    _assert_rows_invariant(lambda t: exact.rms_norm(t, w, 1e-6), x, "rms_norm")
    _assert_rows_invariant(lambda t: exact.silu_mul(t, t * 0.5), x, "silu_mul")
    _assert_rows_invariant(exact.sigmoid, x.float(), "sigmoid")
    logits = (4 * torch.randn(300, 1000)).float()
    _assert_rows_invariant(exact.log_softmax, logits, "log_softmax")
    wide = x.double()
    ref_norm = w.double() * wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
    _assert_close(exact.rms_norm(x, w, 1e-6), ref_norm, dtype)
    _assert_close(exact.silu_mul(x, x), F.silu(wide) * wide, dtype)
    _assert_close(exact.log_softmax(logits), torch.log_softmax(logits.double(), -1), torch.float32)
    _assert_close(exact.sigmoid(x.float()), torch.sigmoid(wide), torch.float32)


def _assert_close(got: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    """Within a few roundings of `dtype` of the fp64 value (relative, absolute near 0)."""
    rtol = 1e-5 if dtype == torch.float32 else 2**-6
    excess = ((got.double() - ref).abs() - rtol * (ref.abs() + 1)).max().item()
    assert excess <= 0, excess


def test_gradients_are_right_in_fp64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 7, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    torch.autograd.gradcheck(exact.linear, (x, w), fast_mode=True)
    torch.autograd.gradcheck(lambda a, b: exact.rms_norm(a, b, 1e-6), (x, v))
    torch.autograd.gradcheck(exact.log_softmax, (x,))
    torch.autograd.gradcheck(lambda a: exact.silu_mul(a, a), (x,))
    q = torch.randn(2, 4, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 4, 1, 4, dtype=torch.float64, generator=g, requires_grad=True)
    val = torch.randn(2, 4, 1, 4, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.zeros(2, 4, dtype=torch.long)
    mask = SequenceLayout.build(ids, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])).mask
    for m in (None, mask):
        torch.autograd.gradcheck(
            lambda a, b, c, m=m: exact.dense_attention(a, b, c, m, sdpa_attention), (q, k, val), fast_mode=True
        )


# ---- attention: decode over the paged cache == replay in the whole sequence ---------------


def _paged_cache(k: torch.Tensor, v: torch.Tensor, seed: int = 0):
    """k/v [B, S, Hkv, D] scattered to random slots of a plane [Hkv, slots, D] that holds junk
    (NaN) elsewhere -> (k_plane, v_plane, slot table [B, S])."""
    b, s, hkv, d = k.shape
    slots = torch.randperm(b * s + 50, generator=torch.Generator().manual_seed(seed))[: b * s].view(b, s)
    k_plane = torch.full((hkv, b * s + 50, d), float("nan"), dtype=k.dtype)
    v_plane = k_plane.clone()
    k_plane[:, slots.reshape(-1)] = k.reshape(b * s, hkv, d).transpose(0, 1)
    v_plane[:, slots.reshape(-1)] = v.reshape(b * s, hkv, d).transpose(0, 1)
    return k_plane, v_plane, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [1, 5, 64, 65, 130])
def test_decode_attention_has_the_bits_of_the_replay(dtype, s):
    b, hq, hkv, d = 3, 4, 2, 16
    g = torch.Generator().manual_seed(s)
    q = torch.randn(b, s, hq, d, generator=g).to(dtype)
    k = torch.randn(b, s, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, s, hkv, d, generator=g).to(dtype)
    replay = exact.dense_forward(q, k, v, None)
    _assert_close(replay, sdpa_attention(q.double(), k.double(), v.double(), None), dtype)
    k_plane, v_plane, slots = _paged_cache(k, v)
    width = 192  # the slot table is wider than any row's context, as the engine's is
    for i in sorted({0, 1, s // 2, 62, 63, 64, 65, 127, 128, s - 1} & set(range(s))):  # about the chunk edges
        # query i of every row in one decode batch, then alone
        table = torch.cat([slots, torch.zeros(b, width - s, dtype=torch.long)], 1)
        valid = torch.arange(width)[None, :] <= i
        out = exact.paged_attention(q[:, i], k_plane, v_plane, table, valid.expand(b, width))
        assert torch.equal(out, replay[:, i]), f"query {i}: decode differs from the replay"
        alone = exact.paged_attention(
            q[:1, i], k_plane, v_plane, table[:1, : 64 * (i // 64 + 1)], valid[:, : 64 * (i // 64 + 1)]
        )
        assert torch.equal(alone, replay[:1, i]), f"query {i}: decode alone differs"


@pytest.mark.parametrize("dtype", DTYPES)
def test_replay_attention_is_the_same_padded_packed_or_alone(dtype):
    hq, hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(9)
    lengths = [70, 5, 33]
    seqs = [tuple(torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv)) for n in lengths]
    alone = [exact.dense_forward(q[None], k[None], v[None], None)[0] for q, k, v in seqs]
    packed = [torch.cat([x[j] for x in seqs])[None] for j in range(3)]
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    layout = SequenceLayout.build(docs, document_ids=docs)
    out = exact.dense_forward(*packed, layout.mask)[0]
    start = 0
    for n, ref in zip(lengths, alone, strict=True):
        assert torch.equal(out[start : start + n], ref)
        start += n
    width = 75  # padded rows, left and right
    for left in (False, True):
        rows, masks = [], []
        for q, k, v in seqs:
            pad = width - q.shape[0]
            padding = (0, 0, 0, 0, pad, 0) if left else (0, 0, 0, 0, 0, pad)
            rows.append([F.pad(x, padding) for x in (q, k, v)])
            real = torch.ones(q.shape[0], dtype=torch.long)
            masks.append(F.pad(real, (pad, 0) if left else (0, pad)))
        batch = [torch.stack([r[j] for r in rows]) for j in range(3)]
        mask = torch.stack(masks)
        layout = SequenceLayout.build(mask, attention_mask=mask)
        out = exact.dense_forward(*batch, layout.mask)
        for i, (n, ref) in enumerate(zip(lengths, alone, strict=True)):
            got = out[i, width - n :] if left else out[i, :n]
            assert torch.equal(got, ref), f"row {i} (left={left})"


# ---- the model --------------------------------------------------------------------------


def _model(dtype, exact_mode: bool = True):
    model = build(tiny_config(), dtype=dtype, seed=4, std=0.1)
    model.execution = EXACT if exact_mode else ExecutionSettings()
    return model


def _seq(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g), torch.randint(1, 5, (n,), generator=g)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_logits_are_bitwise_the_same_alone_padded_and_packed(dtype):
    model = _model(dtype)
    seqs = [_seq(n, seed) for seed, n in enumerate((9, 70, 4))]
    with torch.no_grad():
        alone = [model(ids[None], depths=dep[None])[0] for ids, dep in seqs]
        width = 70
        ids = torch.stack([F.pad(i, (0, width - len(i))) for i, _ in seqs])
        dep = torch.stack([F.pad(d, (0, width - len(d)), value=1) for _, d in seqs])
        mask = torch.stack([F.pad(torch.ones(len(i), dtype=torch.long), (0, width - len(i))) for i, _ in seqs])
        padded = model(ids, depths=dep, attention_mask=mask)
        docs = torch.cat([torch.full((len(i),), j) for j, (i, _) in enumerate(seqs)])[None]
        packed = model(
            torch.cat([i for i, _ in seqs])[None], depths=torch.cat([d for _, d in seqs])[None], document_ids=docs
        )[0]
    start = 0
    for j, ref in enumerate(alone):
        n = ref.shape[0]
        assert torch.equal(padded[j, :n], ref), f"sequence {j} padded"
        assert torch.equal(packed[start : start + n], ref), f"sequence {j} packed"
        start += n
    default = _model(dtype, exact_mode=False)
    with torch.no_grad():
        plain = default(seqs[0][0][None], depths=seqs[0][1][None])[0]
    assert (plain.float() - alone[0].float()).abs().max() < (1e-4 if dtype == torch.float32 else 0.1)


def test_model_gradients_are_within_fp32_rounding_of_the_default():
    check_gradients_near_the_default("cpu")


def check_gradients_near_the_default(device: str) -> None:
    """Exact mode's parameter gradients (its own kernels forward, ordinary ones backward; on
    CUDA the stacked projections, the row kernels' pullbacks and the paged replay attention)
    are the default mode's (eager) within fp32 rounding. Shared with tests/gpu/test_exact_gpu.py."""
    grads = {}
    ids, dep = (t.to(device) for t in _seq(40, 11))
    for mode in (False, True):
        model = _model(torch.float32, exact_mode=mode).to(device)
        if not mode:
            model.execution = ExecutionSettings(compile="off")
        with executing(model.execution):
            logp = pointwise.log_softmax(model(ids[None], depths=dep[None], recompute=mode)[0].float())
            logp[:, 3].sum().backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, g in grads[False].items():
        scale = g.abs().max().item() + 1e-12
        assert (grads[True][name] - g).abs().max().item() <= 1e-4 * scale, name


def test_exit_gate_is_batch_invariant():
    model = _model(torch.float32)
    h = torch.randn(100, 64)
    _assert_rows_invariant(model.exit_lambda, h, "exit_lambda")
    gate = model.model.early_exit_gate
    assert torch.allclose(model.exit_lambda(h), torch.sigmoid(gate(h)).squeeze(-1), atol=1e-6)


def test_default_mode_is_unchanged_by_the_exact_ops():
    """Without `exact` the forward computes what it always did (F.linear, SDPA, torch's norms)."""
    model = _model(torch.float32, exact_mode=False)
    ids, dep = _seq(12, 2)
    with torch.no_grad():
        before = model(ids[None], depths=dep[None])
    assert not active_settings().exact
    x = torch.randn(5, 64)
    assert torch.equal(pointwise.log_softmax(x), torch.log_softmax(x, -1))
    with torch.no_grad():
        assert torch.equal(model(ids[None], depths=dep[None]), before)


def _saved_bytes(fn, *args) -> int:
    """Bytes of the tensors autograd keeps for the backward of fn(*args), parameters aside."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return out, sum(n for ptr, n in seen.items() if ptr not in inputs)


@pytest.mark.parametrize("name", ["rms_norm", "silu_mul", "log_softmax"])
def test_chains_keep_only_their_inputs_and_differentiate_to_the_same_bits(name):
    """The norms, SwiGLU and the log-softmax spell their roundings out in fp32 intermediates;
    differentiated, they keep only their inputs and re-run in backward, which gives the very
    gradients of the chain run once (an exact-mode micro-batch kept 2.6x the default's
    activations before: rl/sizing.py)."""
    g = torch.Generator().manual_seed(4)
    x, y = (torch.randn(64, 256, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(torch.bfloat16).requires_grad_()
    wide = torch.randn(64, 256, generator=g, requires_grad=True)
    args = {"rms_norm": (x, w, 1e-6), "silu_mul": (x, y), "log_softmax": (wide,)}[name]
    leaves = [a for a in args if isinstance(a, torch.Tensor)]
    runs = []
    for fn in (getattr(exact, name), getattr(exact, "_" + name)):
        out, kept = _saved_bytes(fn, *args)
        runs.append((out, torch.autograd.grad(out.float().square().sum(), leaves), kept))
    (out, grads, kept), (ref_out, ref_grads, ref_kept) = runs
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    assert kept == 0 < ref_kept  # the plain chain keeps fp32 intermediates, the wrapped one only its inputs
