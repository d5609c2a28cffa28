"""Paged KV cache with one plane per loop: a block allocator and the K/V storage.

Why our own: paged-attention libraries (vLLM, FlashInfer, SGLang) page one K/V plane per
layer. Ouro needs T planes per layer (one per loop) with the *last-exited* layout of
docs/model.md §3: a token that ran e loops has real K/V in planes 1..e and planes e+1..T
hold a copy of plane e, so a later query at loop d reads version min(d, e) with a plain
per-plane lookup.

Layout: `k`, `v` are [L, P, Hkv, (blocks + 1) * block_size, R] views of one flat buffer
(head-major, so that a gather of slots gives [Hkv, B, n, R], which batched matmuls take
without copies). A row R is a token's K (or V) of one head: D values in the model's dtype, or
with `fp8` the `kv_quant.row_bytes(D)` bytes of model/kv_quant.py's packed format (fp8 values,
the scale's exponent, padding to 16 bytes), so every copy of slots moves a token's scale with
it. `write` packs and `read` unpacks; `plane` gives the rows as stored, which the attention unpacks after its gather
(`kv_quant.values`). A sequence owns a list of blocks; its token at position p lives in
slot `blocks[p // bs] * bs + p % bs` of every plane. Planes are 0-based here (plane
index t-1 holds loop t). The block ids a sequence gets never influence values, so
allocation order cannot change outputs. One extra block past `num_blocks` is never
handed out: its first slot is the scratch slot that padding rows of a decode batch
write to and padded context positions point at.

Planes follow the budget: a `generate` whose requests decode at most K loops reads
only planes 1..K (a query at loop d reads plane d), so the same bytes are re-viewed
with P = K planes per token (`set_planes`, only while no block is in use). Prefill still
runs all T loops and writes the planes the view has. `num_blocks` is the block count of
the current view; `blocks_at(P)` gives it for any P.

Memory can be handed back while the engine is idle (`release`, e.g. while a colocated
trainer steps) and taken again (`restore`), then only as large as asked (at most the
capacity): a `generate` asks for what its requests can ever hold, so a call that needs a
small cache leaves the rest of the device to others (the trainer's optimizer state). A
cache that holds every request's longest KV never refuses a block, so the schedule, and
with it every output, is the one the whole capacity gives. Contents are not kept, which is safe
because every slot a step reads was written by the same sequence after the last
invalidation (see `invalidate`); a restored buffer is zeroed, so even unwritten slots
hold finite values. `generation` counts restores. A restore's size is rounded up to a
step of the capacity (`restore_blocks`), so calls of one shape restore the very same view;
on CUDA the buffer keeps its addresses across a release (kv_memory.ReservedBuffer), and
`layout` (addresses, planes, blocks) then repeats too: the CUDA graphs captured on a
layout (runner.py) stay valid for as long as it comes back.
"""

from __future__ import annotations

import torch

from ouro_cli.host_to_device import to_device
from ouro_cli.model import kv_quant

from .kv_memory import device_buffer

RESTORE_STEPS = 64  # a restored cache holds a multiple of 1/64 of its capacity (`restore_blocks`)


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than asked for (the scheduler prevents this)."""


class BlockAllocator:
    """A free list of block ids with a reference count per block in use; lowest ids first on a
    fresh allocator.

    `allocate` hands out blocks with one reference each, `share` adds a reference to blocks in
    use (the samples of a group reading one prompt's full blocks), and `free` drops one
    reference per block: a block returns to the free list when its last reference goes, so
    `num_free` counts a shared block once. Freeing a block that holds no reference, or sharing
    a free one, is refused: either would hand one block to two owners that do not know of
    each other."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.reset()

    def reset(self) -> None:
        """Every block free, no reference held."""
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def references(self, block: int) -> int:
        """The references `block` holds (0: free)."""
        return self._refs.get(block, 0)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> list[int]:
        """One more reference to each of `blocks` (in use) -> the same ids, for the new owner."""
        for b in blocks:
            if b not in self._refs:
                raise RuntimeError(f"KV block {b} shared while free")
        for b in blocks:
            self._refs[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`; those left with none are free again."""
        for b in blocks:
            refs = self._refs.get(b, 0)
            if refs == 0:  # a double free would hand one block to two sequences
                raise RuntimeError(f"KV block {b} freed twice")
            if refs == 1:
                del self._refs[b]
                self._free.append(b)
            else:
                self._refs[b] = refs - 1


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def restore_blocks(blocks: int, capacity: int) -> int:
    """The blocks a released cache of `capacity` blocks (at the view's planes) comes back with
    for a call that can hold `blocks` at once: rounded up to a multiple of capacity /
    RESTORE_STEPS, at most the capacity. Rollouts of one shape differ by a few prompt tokens;
    rounded, they restore one view, whose CUDA graphs then need no new capture."""
    step = max(1, capacity // RESTORE_STEPS)
    return min(capacity, -(-max(blocks, 1) // step) * step)


def capacity_blocks(kv_blocks: int, num_loops: int, planes: int, block_size: int) -> int:
    """Blocks (scratch excluded) a cache of `kv_blocks` blocks at `num_loops` planes holds when
    viewed with `planes` planes: the same bytes, re-cut (`PagedKVCache.blocks_at`)."""
    return (num_loops * (kv_blocks + 1) * block_size // planes) // block_size - 1


def request_blocks(kv_tokens: int, draft_tokens: int, block_size: int) -> int:
    """The most blocks one request holds at once: its longest KV (`kv_tokens`, prompt +
    max_tokens - 1) plus a token in flight and its draft tokens. A cache of the sum over a
    call's requests (and the scratch block) never runs out, so it schedules them as a cache
    of any larger size does."""
    return blocks_needed(kv_tokens + 2 + draft_tokens, block_size)


def prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """The blocks of a prompt that the samples of its group share: its full ones. The partial
    last block is each sample's own, since a sample writes its first generated tokens there."""
    return prompt_tokens // block_size


def group_blocks(prompt_tokens: int, requests: list[tuple[int, int]], block_size: int) -> int:
    """The most blocks a group of requests on one prompt of `prompt_tokens` tokens holds at once,
    each request given as (its longest KV, its draft tokens) (`request_blocks`): the prompt's
    full blocks once, and every request's own blocks past them."""
    shared = prompt_blocks(prompt_tokens, block_size)
    return shared + sum(request_blocks(kv, draft, block_size) - shared for kv, draft in requests)


def most_call_blocks(
    sequences: int, prompts: int, prompt_tokens: int, max_tokens: int, draft_tokens: int, block_size: int
) -> int:
    """The most blocks a call holds at once (`group_blocks` summed over its groups) when its
    `sequences` requests of at most `max_tokens` tokens each lie on at most `prompts` distinct
    prompts of at most `prompt_tokens` tokens, whatever the prompts' lengths and the groups' sizes.

    A group of G on a prompt of q full blocks and r more tokens holds q + G × (blocks of r + the
    response), so a longer prompt never holds less within one count of full blocks, and a prompt
    one token short of its last full block (q - 1 full blocks, r = block_size - 1) may hold one
    more block per sample but the first: that is the bound's last term."""
    prompts = min(prompts, sequences)

    def own(m: int) -> int:  # a sample's blocks past its prompt's full ones
        return request_blocks(m + max_tokens - 1, draft_tokens, block_size) - prompt_blocks(m, block_size)

    full = prompt_blocks(prompt_tokens, block_size)
    blocks = prompts * full + sequences * own(prompt_tokens)
    if full:
        blocks += (sequences - prompts) * (own(full * block_size - 1) - own(prompt_tokens))
    return blocks


class PagedKVCache:
    """K/V storage for L layers × P loop planes (P ≤ T), addressed by slot.

    `num_blocks` given at construction is the capacity at T planes; the buffer holds
    exactly those bytes whatever view is active."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_loops: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fixed_address: bool | None = None,
        fp8: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"kv_blocks must be >= 1, got {num_blocks}")
        self.num_layers, self.num_loops = num_layers, num_loops
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        # `dtype`: the K/V values' (the model's); `storage_dtype`: the buffer's, `row` elements a row
        self.dtype, self._device, self.fp8 = dtype, torch.device(device), fp8
        self.storage_dtype = torch.uint8 if fp8 else dtype
        self.row = kv_quant.row_bytes(head_dim, self.storage_dtype.itemsize, fp8) // self.storage_dtype.itemsize
        # one K (or V) half of the buffer at capacity: T planes of num_blocks + 1 blocks (incl.
        # scratch); `_half` is the allocated buffer's (at most this)
        self._capacity_half = num_layers * num_loops * num_kv_heads * (num_blocks + 1) * block_size * self.row
        self._half = self._capacity_half
        self.generation = 0
        self.planes = num_loops
        # the K and V halves, each its own buffer (`fixed_address`: kv_memory.device_buffer)
        self._buffers = tuple(
            device_buffer(self._capacity_half, self.storage_dtype, self._device, fixed_address) for _ in range(2)
        )
        self._storage: tuple[torch.Tensor, torch.Tensor] | None = None
        self.restore()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def released(self) -> bool:
        return self._storage is None

    @property
    def fixed_address(self) -> bool:
        """Whether a restore brings the buffer back at its addresses (kv_memory.py)."""
        return all(b.fixed_address for b in self._buffers)

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """(K address, V address, planes, blocks) of the held view: a CUDA graph captured on one
        layout replays correctly whenever the cache holds that layout again."""
        return self.k.data_ptr(), self.v.data_ptr(), self.planes, self.num_blocks

    def blocks_at(self, planes: int, *, capacity: bool = False) -> int:
        """Blocks (scratch excluded) that the allocated buffer (or, with `capacity`, the whole
        capacity) holds with `planes` planes per token."""
        if not 1 <= planes <= self.num_loops:
            raise ValueError(f"planes must lie in 1..{self.num_loops}, got {planes}")
        half = self._capacity_half if capacity else self._half
        slots = half // (self.num_layers * planes * self.num_kv_heads * self.row)
        return slots // self.block_size - 1

    def set_planes(self, planes: int) -> None:
        """Re-view the buffer with `planes` planes per token; every block must be free. While
        released, the view is made when the memory is restored."""
        if planes == self.planes:
            return
        if self.allocator.num_free != self.allocator.num_blocks:
            raise RuntimeError("the KV cache cannot change its planes while blocks are in use")
        self.blocks_at(planes)  # checks the range
        self.planes = planes
        if not self.released:
            self._view()

    def _view(self) -> None:
        self.num_blocks = self.blocks_at(self.planes)
        shape = (
            self.num_layers,
            self.planes,
            self.num_kv_heads,
            (self.num_blocks + 1) * self.block_size,
            self.row,
        )
        n = self.num_layers * self.planes * self.num_kv_heads * shape[3] * self.row
        self.scratch_slot = self.num_blocks * self.block_size
        self.k = self._storage[0][:n].view(shape)
        self.v = self._storage[1][:n].view(shape)
        self.allocator = BlockAllocator(self.num_blocks)

    def release(self) -> None:
        """Give the buffer's memory back (the engine is idle; nothing cached survives)."""
        self._storage = self.k = self.v = None
        for buffer in self._buffers:
            buffer.give_back()

    def restore(self, blocks: int | None = None, most: int | None = None) -> None:
        """Allocate (zeroed) storage again after `release`, with the current planes: room for
        `blocks` blocks of the current view rounded up (`restore_blocks`), at most the capacity
        (None: the capacity) and at most `most` blocks (a limit is not rounded up)."""
        if self._storage is not None:
            return
        self._half = self._capacity_half
        if blocks is not None:
            per_block = self.num_layers * self.planes * self.num_kv_heads * self.block_size * self.row
            rounded = restore_blocks(blocks, self.blocks_at(self.planes, capacity=True))
            if most is not None:
                rounded = min(rounded, most)
            self._half = min(self._capacity_half, (rounded + 1) * per_block)
        try:
            self._storage = (self._buffers[0].take(self._half), self._buffers[1].take(self._half))
        except BaseException:  # out of memory, say: neither half stays taken
            for buffer in self._buffers:
                buffer.give_back()
            raise
        self.generation += 1
        self._view()

    def close(self) -> None:
        """Free the memory and, at a fixed address, the reserved address range."""
        self.release()
        for buffer in self._buffers:
            buffer.close()

    def bytes_per_token(self) -> int:
        """Bytes one cached token occupies over all layers and planes of the view (K and V)."""
        return 2 * self.num_layers * self.planes * self.num_kv_heads * self.row * self.storage_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return 2 * self._half * self.storage_dtype.itemsize

    def slots(self, blocks: list[int], start: int, end: int) -> list[int]:
        """Slot ids of positions start..end-1 of a sequence owning `blocks`."""
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def slot_table(
        self, block_table: torch.Tensor, lengths: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ids [B, width] of positions 0..width-1 per row and the mask of positions < length,
        from `block_table` [B, >= width/bs] (padded with the scratch block id `num_blocks`) and
        `lengths` [B]; positions past a row's length point at the scratch slot. Runs on the
        tensors' device without reading them (a captured decode step computes it)."""
        pos = torch.arange(width, device=block_table.device)
        slots = block_table[:, pos // self.block_size] * self.block_size + pos % self.block_size
        valid = pos[None, :] < lengths[:, None]
        return torch.where(valid, slots, torch.full_like(slots, self.scratch_slot)), valid

    def write(self, layer: int, plane: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, Hkv, D] into `slots` [N] of (layer, plane); with `fp8` packed (kv_quant.pack:
        values the layer already rounded are stored as they are, bit for bit)."""
        self.k[layer, plane].index_copy_(1, slots, self._rows(k).transpose(0, 1))
        self.v[layer, plane].index_copy_(1, slots, self._rows(v).transpose(0, 1))

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return kv_quant.pack(x) if self.fp8 else x.to(self.storage_dtype)

    def read(self, layer: int, plane: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at `slots` [N] of (layer, plane) -> [N, Hkv, D] in `dtype`."""
        k, v = self.k[layer, plane][:, slots], self.v[layer, plane][:, slots]
        d = self.head_dim
        return kv_quant.values(k, self.dtype, d).transpose(0, 1), kv_quant.values(v, self.dtype, d).transpose(0, 1)

    def plane(self, layer: int, plane: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V planes of (layer, plane) as stored: [Hkv, slots, R] views (R = D, or the
        packed fp8 rows' kv_quant.row_bytes(D))."""
        return self.k[layer, plane], self.v[layer, plane]

    def copy_slots(self, source: list[int], dest: list[int]) -> None:
        """K/V of every layer and plane at slots `source` copied to slots `dest`."""
        src = to_device(source, torch.long, self.device)
        dst = to_device(dest, torch.long, self.device)
        self.k.index_copy_(3, dst, self.k.index_select(3, src))
        self.v.index_copy_(3, dst, self.v.index_select(3, src))

    def copy_forward(self, slots: torch.Tensor, last_plane: int) -> None:
        """Planes last_plane+1.. := plane last_plane at `slots`, in every layer (last-exited layout)."""
        for plane in range(last_plane + 1, self.planes):
            self.k[:, plane, :, slots] = self.k[:, last_plane, :, slots]
            self.v[:, plane, :, slots] = self.v[:, last_plane, :, slots]

    def invalidate(self) -> None:
        """Forget every sequence's KV (weights changed): all blocks free.

        The contents stay: a sequence writes every (layer, plane) slot of a position
        before any step reads it (prefill fills all planes, decode all planes of its
        new token), and positions past a row's length are never read or are masked
        with probability 0. Stale values are finite K/V of earlier steps, so 0·v stays 0.
        Zeroing the planes instead would cost a full pass over the cache on every
        weight publication."""
        self.allocator.reset()
