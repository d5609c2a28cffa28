"""Batch-invariant forward ops for exact mode (`--exact`, ExecutionSettings.exact; docs/exact.md).

In exact mode every value a forward pass computes for a token is a function of that
token's own inputs alone: not of the batch size, the number of rows in a product, the
sequence length or the phase (prefill, decode, replay). The engine then samples from, and
reports, the very logprobs the trainer recomputes, in bf16 as in fp32. Each op gets one
summation order that no shape can change (the table of docs/exact.md §2):

- **Sums** (`row_sum`): a pairwise tree of elementwise adds whose shape depends only on the
  summed length; an elementwise add is one IEEE operation per element in every code path,
  which torch's reduction kernels do not promise.
- **Maxima** (`amax`) are exact in any order.
- **Elementwise functions** use only ops with one code path per element (`exp`, `log`,
  `rsqrt`, + - * /); sigmoid and silu are 1 / (1 + exp(-x)), as torch's CPU kernels compute
  a tensor's tail with another formula than its body.
- **Row functions on CUDA** (the norms, silu·up, log-softmax): one Triton kernel each
  (kernels/exact_rows.py), an order fixed by the row's length (why:
  docs/performance.md#exact-mode).
- **Projections** (`linear`): on CPU F.linear on fixed tiles of ROW_TILE rows, the last
  zero-padded; on CUDA a fixed-tile Triton kernel with no split-K (kernels/fixed_tile.py).
- **Attention** (`dense_attention`, `paged_attention`, CPU): keys in chunks of KEY_CHUNK at
  absolute offsets from the document's start, folded into one fp32 online softmax (`_fold`)
  for a decode query and for the same query in the replay; keys past the query are exact
  zeros. On CUDA the decode kernel serves both (kernels/replay_attention.py).

Backward passes may use ordinary kernels (the gradients of the same function): `linear` and
the attention through F.linear's and SDPA's, the elementwise and row functions through
autograd, keeping only their inputs and re-running in backward (`_keeping_inputs`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ouro_cli.settings import exact_kernels

from . import formulas, kv_quant

ROW_TILE = 16  # rows per GEMM call on CPU
KEY_CHUNK = 64  # keys per attention chunk (CPU), at absolute positions


def _wide(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (fp64 stays fp64, for the tests' references and gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


# ---- sums ---------------------------------------------------------------------------


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis as a pairwise tree of elementwise adds: [..., n] -> [...].
    The order is a function of n alone (`lead_sum` of the axis moved to the front)."""
    return lead_sum(x.movedim(-1, 0).contiguous())


def lead_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the first axis, [n, ...] -> [...], as a pairwise tree: level by level the first
    half plus the second (an odd element left over joins the next level). With the summed axis
    in front each level adds two contiguous blocks."""
    while x.shape[0] > 1:
        n = x.shape[0]
        half = n // 2
        folded = x[:half] + x[half : 2 * half]
        x = torch.cat([folded, x[2 * half :]]) if n % 2 else folded
    return x[0]


# ---- elementwise and row functions ------------------------------------------------------


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def _keeping_inputs(fn):
    """`fn` (a chain of elementwise and row ops) that, where it is differentiated, keeps only its
    inputs for backward and re-runs itself there (torch.utils.checkpoint): the chains below
    spell every rounding out in fp32 intermediates, and autograd would otherwise keep four or
    five of them per element. The re-run computes the same bits, so the gradients are those of
    the plain function."""

    @functools.wraps(fn)
    def run(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        return fn(*args)

    return run


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, silu computed wide and rounded to gate's dtype (as F.silu rounds)."""
    g = gate.to(_wide(gate.dtype))
    return (g * sigmoid(g)).to(gate.dtype) * up


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`w * (x_wide * rsqrt(mean(x_wide^2) + eps)).to(x.dtype)` (docs/model.md §2), mean by `row_sum`."""
    wide = x.to(_wide(x.dtype))
    mean_square = row_sum(wide * wide) / x.shape[-1]
    normed = wide * torch.rsqrt(mean_square + eps)[..., None]
    return weight * normed.to(x.dtype)


def _add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return h + _rms_norm(x, weight, eps)


def _add_rms_norm_then_norm(h, x, weight, next_weight, eps):
    h = h + _rms_norm(x, weight, eps)
    return h, _rms_norm(h, next_weight, eps)


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last axis (x wide: the logprobs' fp32). The max is exact in any
    order and, as log_softmax does not depend on it, carries no gradient."""
    top = x.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # an all -inf row stays NaN-free up to here
    shifted = x - top
    return shifted - torch.log(row_sum(torch.exp(shifted)))[..., None]


def _row_kernels(*tensors: torch.Tensor):
    """kernels/exact_rows.py where exact mode runs its Triton kernels on these tensors' device
    (CUDA; the Triton interpreter) and they take their dtypes, else None (this module's torch)."""
    if not exact_kernels(tensors[0].device.type):
        return None
    from ouro_cli.kernels import exact_rows

    return exact_rows if exact_rows.supported(*tensors) else None


def _twin(name: str, fn, *dtype_args: int):
    """What the model calls for `name`: kernels/exact_rows.py's kernel of that name where it runs
    (one launch; `dtype_args`: the positions of the tensors whose dtypes it checks), else `fn`
    keeping only its inputs for backward."""
    kept = _keeping_inputs(fn)

    @functools.wraps(fn)
    def run(*args):
        kernels = _row_kernels(*(args[i] for i in dtype_args))
        return getattr(kernels, name)(*args) if kernels is not None else kept(*args)

    return run


# what the model calls (model/pointwise.py's exact twins, the trainer's loss)
silu_mul = _twin("silu_mul", _silu_mul, 0, 1)
rms_norm = _twin("rms_norm", _rms_norm, 0, 1)
add_rms_norm = _twin("add_rms_norm", _add_rms_norm, 0, 1, 2)
add_rms_norm_then_norm = _twin("add_rms_norm_then_norm", _add_rms_norm_then_norm, 0, 1, 2, 3)
log_softmax = _twin("log_softmax", _log_softmax, 0)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k: kernels/exact_rows.py's kernel where exact mode runs its kernels (two
    launches where the eager formula makes ten), else the plain formula (model/formulas.py),
    which is elementwise and so batch-invariant as it is."""
    kernels = _row_kernels(q, k, cos, sin)
    if kernels is not None and kernels.rotary_supported(q):
        return kernels.rotary(q, k, cos, sin)
    return formulas.rotary(q, k, cos, sin)


def exit_lambda(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """λ = sigmoid(gate(h)) in fp32, shape h.shape[:-1]: the gate's product through `linear`."""
    z = linear(h, weight) + bias
    return sigmoid(z.float()).squeeze(-1)


# ---- projections ------------------------------------------------------------------------


def linear(x: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """x [..., K] @ w[N, K].T -> [..., N], each row's bits a function of that row and w only. A
    sequence of weights multiplies as their stacked matrix (matmul.linear); the stack is not kept
    for backward, which stacks them again."""
    weights = (w,) if isinstance(w, torch.Tensor) else tuple(w)
    k, n = x.shape[-1], sum(wi.shape[0] for wi in weights)
    rows = x.reshape(-1, k)
    if rows.requires_grad or any(wi.requires_grad for wi in weights):
        out = _Linear.apply(rows, *weights)
    else:
        out = _forward(rows, stacked(weights))
    return out.view(*x.shape[:-1], n)


def stacked(w: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """One matrix of `w`'s rows: the tensor itself, or the weights concatenated (a copy, which
    autograd differentiates into a view of the product's weight gradient per weight). Shared
    with model/matmul.py's `linear`."""
    if isinstance(w, torch.Tensor):
        return w
    return w[0] if len(w) == 1 else torch.cat(list(w))


def _forward(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if exact_kernels(rows.device.type):
        from ouro_cli.kernels.fixed_tile import fixed_tile_linear

        return fixed_tile_linear(rows, w)
    return tiled_linear(rows, w)


def tiled_linear(rows: torch.Tensor, w: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """rows [M, K] @ w.T through F.linear on zero-padded tiles of `tile` rows, one call per tile."""
    m, k = rows.shape
    tiles = -(-m // tile)
    padded = rows.new_zeros(tiles * tile, k)
    padded[:m] = rows
    out = rows.new_empty(tiles * tile, w.shape[0])
    with torch.no_grad():
        for t in range(tiles):
            out[t * tile : (t + 1) * tile] = F.linear(padded[t * tile : (t + 1) * tile], w)
    return out[:m]


class _Linear(torch.autograd.Function):
    """The forward in fixed tiles; the backward F.linear's gradient of the same product, split
    into one gradient per weight."""

    @staticmethod
    def forward(ctx, rows, *weights):
        ctx.save_for_backward(rows, *weights)
        return _forward(rows, stacked(weights))

    @staticmethod
    def backward(ctx, grad):
        rows, *weights = ctx.saved_tensors
        grad_rows = grad @ stacked(weights) if ctx.needs_input_grad[0] else None
        grad_ws = [None] * len(weights)
        if any(ctx.needs_input_grad[1:]):
            grad_ws = list((grad.t() @ rows).split([w.shape[0] for w in weights]))
        return grad_rows, *(g if need else None for g, need in zip(grad_ws, ctx.needs_input_grad[1:], strict=True))


# ---- attention (CPU) ----------------------------------------------------------------------


def _fold(state, q, k, v, valid, scale):
    """Fold one chunk of C keys into the online softmax of each query group.

    In the layouts the sums want (the summed axis in front, `lead_sum`): q [D, R, Hkv, G],
    k [D, R, Hkv, C], v [C, R, Hkv, D] (wide), valid [R, C] -> (max [R, Hkv, G], sum
    [R, Hkv, G], acc [R, Hkv, G, D]). Invalid keys score -inf and their values are zeroed,
    so whatever their memory held (another document, a stale cache slot, NaN) contributes
    exact zeros."""
    m, l_sum, acc = state
    v = torch.where(valid.t()[:, :, None, None], v, 0.0)
    s = lead_sum(q[..., None] * k[:, :, :, None, :]) * scale  # [R, Hkv, G, C]
    s = torch.where(valid[:, None, None, :], s, torch.full_like(s, -torch.inf))
    m_new = torch.maximum(m, s.amax(-1))
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)  # 0 before the first key, 1 for a chunk with none
    p = torch.exp(s - m_safe[..., None]).permute(3, 0, 1, 2).contiguous()  # [C, R, Hkv, G]; 0 at invalid keys
    l_sum = l_sum * alpha + lead_sum(p)
    pv = lead_sum(p[..., None] * v[:, :, :, None, :])  # [R, Hkv, G, D]
    return m_new, l_sum, acc * alpha[..., None] + pv


def _start(r: int, hkv: int, g: int, d: int, dtype: torch.dtype, device: torch.device):
    m = torch.full((r, hkv, g), -torch.inf, dtype=dtype, device=device)
    return m, torch.zeros_like(m), torch.zeros(r, hkv, g, d, dtype=dtype, device=device)


def _finish(state, dtype: torch.dtype) -> torch.Tensor:
    _, l_sum, acc = state
    return (acc / l_sum[..., None]).to(dtype)


def visible_runs(
    mask: torch.Tensor | None, b: int, s: int, device: torch.device, needed_by: str = "exact attention"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(start [B, S], length [B, S]) of each query's visible keys, which must be one run
    start..start+length-1 ending at the query (SequenceLayout's masks: causal, documents
    contiguous in a row, padding on the edges). mask: None (causal) or bool [B, 1, S, S].
    Shared with the paged replay kernel (kernels/replay_attention.py), which walks the same
    runs; `needed_by` names the path in the error for a mask of another shape."""
    idx = torch.arange(s, device=device)
    if mask is None:
        return torch.zeros(b, s, dtype=torch.long, device=device), (idx + 1).repeat(b, 1)
    m = mask[:, 0]
    length = m.sum(-1)
    start = idx - length + 1
    inside = (idx[None, None, :] >= start[..., None]) & (idx[None, None, :] <= idx[None, :, None])
    if not bool(torch.equal(inside, m)):
        raise ValueError(
            f"{needed_by} needs each query's visible keys to be one contiguous run ending at "
            "the query (causal, contiguous documents, edge padding)"
        )
    return start, length


def dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D]: each query over its visible keys in chunks
    at positions 0, KEY_CHUNK, ... from its document's start (`paged_attention`'s order)."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g, r = hq // hkv, b * s
    wide = _wide(q.dtype)
    start, length = visible_runs(mask, b, s, q.device)
    first = ((torch.arange(b, device=q.device) * s)[:, None] + start).reshape(r, 1)  # flat index of the run's start
    length = length.reshape(r, 1)
    qg = q.reshape(r, hkv, g, d).to(wide).permute(3, 0, 1, 2).contiguous()  # [D, R, Hkv, G]
    keys, values = k.reshape(r, hkv, d), v.reshape(r, hkv, d)
    offsets = torch.arange(KEY_CHUNK, device=q.device)[None, :]
    state = _start(r, hkv, g, d, wide, q.device)
    for c in range(-(-int(length.max()) // KEY_CHUNK)):
        pos = c * KEY_CHUNK + offsets  # [1, C]
        at = (first + pos).clamp(max=r - 1)  # [R, C]; past a query's run the key is masked
        kc = keys[at].permute(3, 0, 2, 1).to(wide).contiguous()  # [D, R, Hkv, C]
        vc = values[at].permute(1, 0, 2, 3).to(wide).contiguous()  # [C, R, Hkv, D]
        state = _fold(state, qg, kc, vc, pos < length, d**-0.5)
    return _finish(state, q.dtype).view(b, s, hq, d)


class _DenseAttention(torch.autograd.Function):
    """The forward in chunk order; the backward SDPA's gradient of the same attention (recomputed)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, reference):
        ctx.save_for_backward(q, k, v)
        ctx.mask, ctx.reference = mask, reference
        return dense_forward(q, k, v, mask)

    @staticmethod
    def backward(ctx, grad):
        return reference_backward(ctx, grad, extra=2)


def reference_backward(ctx, grad: torch.Tensor, *, extra: int) -> tuple:
    """The backward of an attention Function whose forward saved (q, k, v) and kept `mask` and
    `reference` (an attention with autograd, SDPA's) on ctx: the reference's gradients of q, k
    and v at the same inputs, then None for the `extra` further arguments. Shared with the
    paged replay kernel's Function (kernels/replay_attention.py)."""
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        o = ctx.reference(*leaves, ctx.mask)
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(o, wanted, grad))
    return (*(next(grads) if t.requires_grad else None for t in leaves), *(None,) * extra)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, reference
) -> torch.Tensor:
    """The replay's and the prefill's attention in exact mode (CPU); gradients from
    `reference(q, k, v, mask)` (SDPA)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
        return dense_forward(q, k, v, mask)
    return _DenseAttention.apply(q, k, v, mask, reference)


def paged_attention(
    q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, ctx_slots: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """The decode step's attention in exact mode (CPU): q [B, Hq, D], one new token per row;
    k_plane/v_plane [Hkv, slots, R] as the cache stores them (packed fp8 rows are unpacked into
    the wide dtype, which holds kv_quant.py's values exactly); ctx_slots/valid [B, W] the slots
    of positions 0..W-1 and which of them the row sees (its first `length`) -> o [B, Hq, D],
    with the bits `dense_forward` computes for the same query in its sequence."""
    b, hq, d = q.shape
    hkv = k_plane.shape[0]
    g = hq // hkv
    wide = _wide(q.dtype)
    width = ctx_slots.shape[1]
    pad = -width % KEY_CHUNK
    if pad:
        ctx_slots = F.pad(ctx_slots, (0, pad))
        valid = F.pad(valid, (0, pad))
    qg = q.reshape(b, hkv, g, d).to(wide).permute(3, 0, 1, 2).contiguous()  # [D, B, Hkv, G]
    state = _start(b, hkv, g, d, wide, q.device)
    for c in range(ctx_slots.shape[1] // KEY_CHUNK):
        chunk = slice(c * KEY_CHUNK, (c + 1) * KEY_CHUNK)
        slots = ctx_slots[:, chunk]
        kc = kv_quant.values(k_plane[:, slots], wide, d).permute(3, 1, 0, 2).to(wide).contiguous()  # [D, B, Hkv, C]
        vc = kv_quant.values(v_plane[:, slots], wide, d).permute(2, 1, 0, 3).to(wide).contiguous()  # [C, B, Hkv, D]
        state = _fold(state, qg, kc, vc, valid[:, chunk], d**-0.5)
    return _finish(state, q.dtype).reshape(b, hq, d)
