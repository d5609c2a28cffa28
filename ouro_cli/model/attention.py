"""Dense attention over whole sequences: padding, packing (document masking) and causality.

Used by the full-sequence forward (trainer replay, engine prefill, references). The
mask always lets a query see itself, so padded rows never become all-masked (which
would turn softmax into NaN and poison gradients through `torch.where`).

`QueryRows` and `attention_at_rows` are the same attention for a subset of the queries over
all keys: a loop of the forward that only some positions run (OuroForCausalLM.forward).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ouro_cli.errors import SettingError
from ouro_cli.settings import active_settings

from . import exact, unique_rows


@dataclass
class SequenceLayout:
    """Where each position sits: its RoPE position and which positions it may attend to.

    `mask` is None for plain causal attention over unpadded, unpacked rows, else a
    boolean [B, 1, S, S] (True = attend).
    """

    position_ids: torch.Tensor
    mask: torch.Tensor | None
    valid: torch.Tensor | None

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> SequenceLayout:
        b, s = input_ids.shape
        device = input_ids.device
        if attention_mask is None and document_ids is None:
            if position_ids is None:
                position_ids = torch.arange(s, device=device).expand(b, s)
            return cls(position_ids, None, None)
        valid = torch.ones(b, s, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
        docs = torch.zeros(b, s, dtype=torch.long, device=device) if document_ids is None else document_ids.long()
        docs = torch.where(valid, docs, torch.full_like(docs, -1))
        if position_ids is None:
            position_ids = _positions_within_documents(docs, valid)
        idx = torch.arange(s, device=device)
        causal = idx[None, :] <= idx[:, None]
        same_doc = docs[:, :, None] == docs[:, None, :]
        mask = same_doc & causal[None] & valid[:, None, :]
        mask = mask | torch.eye(s, dtype=torch.bool, device=device)[None]
        return cls(position_ids, mask[:, None], valid)


def _positions_within_documents(docs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... restarting at every document start; padding gets position 0."""
    s = docs.shape[1]
    idx = torch.arange(s, device=docs.device).expand_as(docs)
    starts = torch.ones_like(valid)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    start_idx = torch.where(starts & valid, idx, torch.zeros_like(idx))
    start_idx = torch.cummax(start_idx, dim=1).values
    return torch.where(valid, idx - start_idx, torch.zeros_like(idx))


@dataclass
class QueryRows:
    """The positions of a [B, S] layout whose queries are computed, and the keys each one sees.

    `rows` [N]: their flat indices b·S + i, ascending. For SDPA the N queries are laid out per
    layout row, padded to the widest row's count W: `slots` [N] is each one's place b·W + j in
    that [B·W] block and `mask` [B, 1, W, S] (True = attend) its row of the layout's mask.
    A padding slot sees key 0 only (never an all-masked row: see the module docstring) and its
    output is never read. `layout_mask` is the whole layout's mask (None: causal), for the
    paged replay attention, which takes the rows as they are. `row_inverse` [B·S] and
    `slot_inverse` [B·W] map a position and a slot back to its query's index (or -1): the
    gathers of model/unique_rows.py move rows in and out with them.
    """

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    layout_mask: torch.Tensor | None
    row_inverse: torch.Tensor
    slot_inverse: torch.Tensor

    @classmethod
    def build(
        cls,
        selected: torch.Tensor,
        layout_mask: torch.Tensor | None,
        count: int | None = None,
        width: int | None = None,
    ) -> QueryRows:
        """selected [B, S] bool (at least one True) -> the rows it marks. `count` (how many) and
        `width` (the most in one row), where the caller has read them, spare the device two
        round trips."""
        b, s = selected.shape
        device = selected.device
        if count is None:
            rows = selected.flatten().nonzero().squeeze(1)
        else:
            rows = torch.nonzero_static(selected.flatten(), size=count).squeeze(1)
        width = int(selected.sum(1).max()) if width is None else width
        rank = selected.long().cumsum(1).flatten().index_select(0, rows) - 1
        slots = rows.div(s, rounding_mode="floor") * width + rank
        position = torch.zeros(b * width, dtype=torch.long, device=device).index_copy(0, slots, rows % s)
        position = position.view(b, width)
        if layout_mask is None:
            mask = torch.arange(s, device=device)[None, None, :] <= position[..., None]
        else:
            mask = layout_mask[:, 0].gather(1, position[..., None].expand(b, width, s))
        return cls(
            rows,
            slots,
            mask[:, None],
            layout_mask,
            unique_rows.inverse_of(rows, b * s),
            unique_rows.inverse_of(slots, b * width),
        )


PAGED_NEEDS_CUDA = (
    "--replay-attention paged runs a Triton kernel: it needs CUDA (or the Triton interpreter, TRITON_INTERPRET=1)"
)


_KEEPING = [0]  # open `tables_kept` scopes


@contextlib.contextmanager
def one_forward() -> Iterator[None]:
    """The scope of one forward pass for the paged replay attention's tables
    (kernels/replay_attention.py): built for it and dropped when it ends, so that no later
    forward reads a table another one built (inside `tables_kept`, they stay)."""
    if not _KEEPING[0]:
        _forget_tables()
    try:
        yield
    finally:
        if not _KEEPING[0]:
            _forget_tables()


@contextlib.contextmanager
def tables_kept() -> Iterator[list]:
    """A CUDA graph's warm-up and capture: their forwards share the tables (the capture cannot
    build them: that reads the device), and the list yielded holds them when the scope ends,
    for the graph to keep as long as it replays."""
    _forget_tables()
    _KEEPING[0] += 1
    kept: list = []
    try:
        yield kept
    finally:
        _KEEPING[0] -= 1
        tables = sys.modules.get("ouro_cli.kernels.replay_attention")
        kept.extend(tables.held() if tables is not None else [])
        _forget_tables()


def _forget_tables() -> None:
    tables = sys.modules.get("ouro_cli.kernels.replay_attention")  # never loaded: nothing to drop
    if tables is not None:
        tables.forget()


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D]; scale head_dim**-0.5; GQA by head groups.

    SDPA, or with the model's `replay_attention="paged"` (ouro_cli/settings.py) every query
    through the decode attention kernel, in its reduction order (kernels/replay_attention.py);
    that mode never runs inside a compiled region (`compile_layers` leaves them out for it).
    In exact mode (docs/exact.md) the decode kernel's order on CUDA, exact.dense_attention's
    (the CPU decode step's) elsewhere."""
    if active_settings().replay_attention_on(q.device.type) == "exact":
        return exact.dense_attention(q, k, v, mask, sdpa_attention)
    if _paged(q):
        from ouro_cli.kernels.replay_attention import paged_replay_attention

        return paged_replay_attention(q, k, v, mask, sdpa_attention)
    return sdpa_attention(q, k, v, mask)


def attention_at_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    layout_mask: torch.Tensor | None,
    slot_inverse: torch.Tensor,
) -> torch.Tensor:
    """q [1,N,Hq,D] at the N positions of a `QueryRows` (its fields, as tensors: a compiled
    region takes them as arguments), k/v [B,S,Hkv,D] at every position -> [1,N,Hq,D]:
    `dense_attention`'s output at those positions. With `replay_attention="paged"` each query
    runs the decode kernel over its own visible keys, as there; SDPA's gradient of the same."""

    def sdpa(q, k, v, _mask=None):
        return sdpa_attention_at_rows(q, k, v, slots, mask, slot_inverse)

    if _paged(q):
        from ouro_cli.kernels.replay_attention import paged_replay_attention

        return paged_replay_attention(q, k, v, layout_mask, sdpa, rows=rows)
    return sdpa(q, k, v)


def _paged(q: torch.Tensor) -> bool:
    """Whether the active settings put the replay's attention in the decode kernel (never
    inside a compiled region); a SettingError where it cannot run."""
    if torch.compiler.is_compiling() or active_settings().replay_attention_on(q.device.type) != "paged":
        return False
    from ouro_cli.kernels import interpreted

    if not q.is_cuda and not interpreted():
        raise SettingError(PAGED_NEEDS_CUDA)
    return True


def sdpa_attention_at_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    slot_inverse: torch.Tensor,
) -> torch.Tensor:
    """`attention_at_rows` through SDPA: the queries put into their padded [B, W] block, and
    taken out of it, by gathers (model/unique_rows.py)."""
    b, width = mask.shape[0], mask.shape[2]
    hq, d = q.shape[2], q.shape[3]
    block = unique_rows.put(q.new_zeros(b * width, hq, d), slots, slot_inverse, q[0]).view(b, width, hq, d)
    o = sdpa_attention(block, k, v, mask)
    return unique_rows.take(o.reshape(b * width, hq, d), slots, slot_inverse)[None]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """dense_attention through PyTorch's scaled_dot_product_attention (the default)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    # enable_gqa only as a literal, and only when the heads differ (never for Ouro's): in a
    # dynamic compiled region the head counts can be symbolic, and SDPA refuses a symbolic flag
    # (the condition guards on the counts instead)
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)
    return o.transpose(1, 2)
