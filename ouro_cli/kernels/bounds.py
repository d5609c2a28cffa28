"""Bounds checks of the index tensors our kernels dereference, for debugging.

A Triton kernel reads memory at whatever address its index math gives: a slot id past a
plane, a length past its slot table's width or a program block past the queries is an
illegal address on the GPU (or a silent wrong read under the interpreter). With checks on
(`OURO_CHECK_KERNELS=1`, read once by `ouro_cli.kernels.checks_enabled`), every launch of
the attention kernels first checks on the host that each index it will dereference lies
inside its tensor, and raises `KernelIndexError` naming the kernel and the first bad
index otherwise. The checks read the device (a synchronisation per launch), so they are
off by default and skipped while a CUDA graph is being captured; the kernels' own
arithmetic (int64 offsets, masks) is covered by the property tests.
"""

from __future__ import annotations

import torch


class KernelIndexError(IndexError):
    """An index a kernel was about to dereference lies outside its tensor."""


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _fail(kernel: str, what: str) -> None:
    raise KernelIndexError(f"{kernel}: {what}")


def check_attention(
    kernel: str,
    q: torch.Tensor,
    plane_slots: int,
    ctx_slots: torch.Tensor,
    lengths: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor] | None,
    per: int,
    new_slots: torch.Tensor | None = None,
    new_rows: int | None = None,
) -> None:
    """The decode kernel's indices: each program's rows read `ctx_slots[row, :length]` (blocked:
    the first query's table row up to the block's longest length), every slot inside the
    plane's `plane_slots`; blocked programs cover queries first..first+count-1 < B with count
    <= `per`; a write puts row b's K/V at `new_slots[b]` < plane_slots."""
    b = q.shape[0]
    lengths = lengths.long().cpu()
    table = ctx_slots.long().cpu()
    rows, width = table.shape
    if lengths.shape[0] < b:
        _fail(kernel, f"{lengths.shape[0]} lengths for {b} queries")
    if (lengths[:b] < 0).any():
        _fail(kernel, f"negative length at query {int((lengths[:b] < 0).nonzero()[0])}")
    if blocks is None:
        readers, reach = torch.arange(b), lengths[:b]
    else:
        first, count = (x.long().cpu() for x in blocks)
        if first.shape != count.shape:
            _fail(kernel, f"first {tuple(first.shape)} and count {tuple(count.shape)} differ")
        bad = (count < 1) | (count > per) | (first < 0) | (first + count > b)
        if bad.any():
            p = int(bad.nonzero()[0])
            _fail(
                kernel, f"program {p} runs queries {int(first[p])}..+{int(count[p])} of {b} (at most {per} a program)"
            )
        # a block reads its first query's table row up to its longest member's length
        program = torch.arange(first.shape[0]).repeat_interleave(count)
        query = first[program] + torch.arange(program.shape[0]) - (count.cumsum(0) - count)[program]
        reach = torch.zeros(first.shape[0], dtype=torch.long).index_reduce_(0, program, lengths[query], "amax")
        readers = first
    if readers.numel() and int(readers.max()) >= rows:
        _fail(kernel, f"query {int(readers.max())} reads slot-table row {int(readers.max())} of {rows}")
    if reach.numel() and int(reach.max()) > width:
        i = int(reach.argmax())
        _fail(kernel, f"query {int(readers[i])} attends {int(reach[i])} positions, its slot table has {width}")
    for at in range(0, readers.shape[0], 4096):  # in slices: a replay's table is queries x positions
        part, upto = table[readers[at : at + 4096]], reach[at : at + 4096]
        read = torch.arange(width)[None, :] < upto[:, None]
        outside = read & ((part < 0) | (part >= plane_slots))
        if outside.any():
            i, j = (int(x) for x in outside.nonzero()[0])
            _fail(
                kernel,
                f"query {int(readers[at + i])} reads slot {int(part[i, j])} at position {j}, of a plane "
                f"of {plane_slots}",
            )
    if new_slots is not None:
        ids = new_slots.long().cpu()[:b]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= plane_slots):
            _fail(kernel, f"writes slot {int(ids.max())} of a plane of {plane_slots}")
        if new_rows is not None and new_rows < b:
            _fail(kernel, f"{new_rows} new K/V rows for {b} queries")


def check_cascade(kernel: str, ctx_slots: torch.Tensor, lengths: torch.Tensor, cascade, per: int) -> None:
    """The prefix pass's tables (decode_attention.Cascade): programs hold members[first:first+count]
    with count <= `per`, every row with prefix tiles exactly once; a program's members have the same
    tiles, all below each member's length, and the first member's slots over them."""
    b = lengths.shape[0]
    tiles, members, first, count = (
        x.long().cpu() for x in (cascade.tiles, cascade.members, cascade.first, cascade.count)
    )
    table, lengths = ctx_slots.long().cpu(), lengths.long().cpu()
    if ((count < 0) | (count > per) | (first < 0) | (first + count > b)).any():
        _fail(kernel, f"a prefix program holds members outside 0..{b} or more than {per}")
    held = torch.cat([members[f : f + c] for f, c in zip(first.tolist(), count.tolist(), strict=True)])
    if sorted(held.tolist()) != (tiles > 0).nonzero().flatten().tolist():
        _fail(kernel, f"prefix programs hold rows {sorted(held.tolist())}, the rows with prefix tiles differ")
    for f, c in zip(first.tolist(), count.tolist(), strict=True):
        rows = members[f : f + c]
        if c == 0:
            continue
        n = int(tiles[rows[0]]) * cascade.tile
        if (tiles[rows] != tiles[rows[0]]).any() or (lengths[rows] <= n).any():
            _fail(kernel, f"prefix rows {rows.tolist()}: {n} positions, lengths {lengths[rows].tolist()}")
        if (table[rows, :n] != table[rows[0], :n]).any():
            _fail(kernel, f"prefix rows {rows.tolist()} do not share their first {n} slots")
