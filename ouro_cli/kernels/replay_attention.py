"""The whole-sequence forward's attention in the decode kernel's reduction order
(`--replay-attention paged`; model/attention.py dispatches here).

Why: on a GPU the engine's decode attention (decode_attention.py) and the trainer's SDPA
reduce the same softmax in different tile orders, so their bf16 logprobs part from the
first layer on, even where the projections match bit for bit (kernels/gemv.py). Here
every query of the replay runs the decode kernel itself
over its own visible keys: tiles of BLOCK positions at the same offsets from its
document's start, the same fp32 online softmax, P rounded the same way. The kernel's
batch invariance (a row's bits do not depend on its batch-mates or the table's width)
makes a query's output the bits a decode step computes for that token over the same K/V.

The backward is SDPA's gradient of the same attention, recomputed: this mode changes how
the forward rounds, not the function that is differentiated.

On CPU under the Triton interpreter it makes them bitwise equal; on a GPU alone it does
not (other operations differ too; docs/exact.md §1).

Programs: the decode step's program holds one query's G = Hq/Hkv heads in a 16-row MMA tile
(15 rows padding at G = 1). Here a program holds up to 16 / G consecutive queries of one
run (one document's start, so one slot table), `program_blocks` cuts them, and the kernel
(decode_attention.blocked_decode_attention) walks the tiles up to the block's longest run.
Each row still folds the tiles its decode step folds, in the same order, with the same
instruction; a tile past a row's own run leaves that row's state untouched. Sharing a tile's
K/V loads among 16 queries cuts the O(S²) reads per head 16-fold. This is an exactness mode
(and exact mode's attention on CUDA), not the default.

With an fp8 KV cache (model/kv_quant.py) the replay packs its K/V, which its layers already
rounded, into the cache's rows and hands the kernel those, so the kernel loads and converts
them as a decode step loads the engine's cache: the same compiled code on the same bytes. Over
the unpacked values (the same numbers) the kernel is compiled another way (`PACKED` 0), whose
bits on a GPU are not promised to be the packed path's; under the interpreter they are.

Visible keys must be one contiguous run ending at the query, as SequenceLayout builds
them (causal, documents contiguous in a row, padding on the edges): other masks are
refused.
"""

from __future__ import annotations

import torch

from ouro_cli.model import kv_quant
from ouro_cli.model.exact import reference_backward, visible_runs
from ouro_cli.settings import active_settings

from .decode_attention import blocked_decode_attention, queries_per_program

# The tables of the last layout, and of the last query subset: every layer and loop of one
# forward shares its mask (and a loop its rows), so the check, the [B·S, S] slot table and the
# program blocks are built once per forward (per loop), not once per layer call. They belong to
# that forward (`forget`, which the model calls at each forward's start and end), or to one
# CUDA graph: building them reads the device, so a capture reuses the tables of its warm-up,
# and the graph holds them (`held`) for as long as it may replay. No other forward may read
# them: once freed, their memory is reused, and a graph reading it reads junk slot ids.
_last_layout: list = [None, None, None]  # mask, (B, S, device, per), (slots, lengths, keys, blocks)
_last_rows: list = [None, None, None]  # rows, the layout's tables, (slots, lengths, blocks)


def forget() -> None:
    """Drop the tables of the forward that ran last (see `_last_layout`)."""
    _last_layout[:] = [None, None, None]
    _last_rows[:] = [None, None, None]


def held() -> list:
    """The tables cached now, for a captured graph to hold."""
    return [t for t in (_last_layout[2], _last_rows[2]) if t is not None]


def _slot_table(mask: torch.Tensor | None, b: int, s: int, device: torch.device, per: int) -> tuple:
    """(slots [B·S, S], lengths [B·S], keys [B·S], blocks): query (b, i) reads slots
    b·S + start .. b·S + i, keys are the flat index of its run's start, blocks the programs'
    (first, count) over all B·S queries, `per` at most to a program (`program_blocks`)."""
    shape = (b, s, device, per)
    if _last_layout[0] is mask and _last_layout[1] == shape:
        return _last_layout[2]
    start, length = visible_runs(mask, b, s, device, "--replay-attention paged")
    row_base = (torch.arange(b, device=device) * s)[:, None] + start  # [B, S]
    slots = row_base.reshape(-1, 1) + torch.arange(s, device=device)[None, :]
    slots = slots.clamp(max=b * s - 1)  # past a query's length the kernel masks its loads
    keys = row_base.reshape(-1)
    _last_layout[:] = [mask, shape, (slots, length.reshape(-1), keys, program_blocks(keys, per))]
    return _last_layout[2]


def _tables_at(tables: tuple, rows: torch.Tensor | None, per: int) -> tuple:
    """(slots, lengths, blocks) of the queries at `rows` (flat indices), or of all."""
    slots, lengths, keys, blocks = tables
    if rows is None:
        return slots, lengths, blocks
    if _last_rows[0] is not rows or _last_rows[1] is not tables:
        _last_rows[:] = [
            rows,
            tables,
            (
                slots.index_select(0, rows),
                lengths.index_select(0, rows),
                program_blocks(keys.index_select(0, rows), per),
            ),
        ]
    return _last_rows[2]


def program_blocks(keys: torch.Tensor, per: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, count) [P]: the queries, in their order, cut into programs of at most `per`
    (decode_attention.queries_per_program) consecutive queries with one key (their run's
    start, hence one slot table up to their longest length). A new key starts a program."""
    n = keys.shape[0]
    index = torch.arange(n, device=keys.device)
    new = torch.ones(n, dtype=torch.bool, device=keys.device)
    new[1:] = keys[1:] != keys[:-1]
    group_first = torch.cummax(torch.where(new, index, 0), 0).values
    first = torch.nonzero(new | ((index - group_first) % per == 0)).squeeze(1)
    count = torch.diff(first, append=first.new_tensor([n]))
    return first, count


def paged_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D] through the decode kernel: each query gets the
    bits the decode step computes for it, several queries of one run sharing a program's K/V
    reads. With `rows` [N] (flat indices b·S + i), q [1,N,Hq,D] holds only those positions'
    queries (a loop that only they run, model/attention.py `attention_at_rows`) -> [1,N,Hq,D]:
    each query reads the same table row, so its bits are those it has among all B·S."""
    b, s, hkv, d = k.shape
    hq = q.shape[2]
    per = queries_per_program(hq // hkv)
    slots, lengths, (first, count) = _tables_at(_slot_table(mask, b, s, q.device, per), rows, per)
    # one plane per kv head over all B·S positions
    # read as the engine reads its cache: with fp8 K/V its packed rows (module docstring)
    stored = (kv_quant.pack(x) for x in (k, v)) if active_settings().fp8_kv else (k, v)
    k_plane, v_plane = (x.reshape(b * s, hkv, x.shape[-1]).transpose(0, 1).contiguous() for x in stored)
    o = blocked_decode_attention(q.reshape(-1, hq, d), k_plane, v_plane, slots, lengths, first, count)
    return o.view(q.shape)


class _PagedReplayAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, reference, rows):
        ctx.save_for_backward(q, k, v)
        ctx.mask, ctx.reference = mask, reference
        return paged_forward(q, k, v, mask, rows)

    @staticmethod
    def backward(ctx, grad):
        return reference_backward(ctx, grad, extra=3)  # mask, reference, rows


def paged_replay_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    reference,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The forward in the decode kernel's order (only the queries at `rows`, as `paged_forward`);
    gradients from `reference(q, k, v, mask)` (the SDPA attention of model/attention.py)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
        return paged_forward(q, k, v, mask, rows)
    return _PagedReplayAttention.apply(q, k, v, mask, reference, rows)
