"""Continuous batching: which sequences prefill, which decode, and who gives up KV blocks.

Policy (deterministic: it depends only on request order, lengths and the block
budget, never on timing):

- Before each step every running sequence must own a slot for the token it feeds
  next, plus one per draft token when it speculates (`Sequence.lookahead`). When
  blocks run out, the most recently admitted running sequence is
  preempted (its blocks freed, its generated tokens and depths kept) and put back at
  the head of the queue; it is later recomputed by a prefill of prompt + generated
  tokens at their recorded depths, so its outputs do not change.
- Waiting sequences are admitted first come, first served (the head is never
  skipped, so nobody starves) while there is room in the batch, in the prefill token
  budget and in the free blocks; no admission in a step that had to preempt.
- With `reserve` a waiting sequence is admitted only while the free blocks cover what
  it takes now and every block it and the running sequences may still take
  (`kv_cache.request_blocks`, at most the whole cache): a cache too small for every
  sequence holds new ones back instead of admitting them and preempting running ones
  later, so nobody is preempted, at the price of fewer sequences in flight while they
  are far from their longest.
- Nobody can deadlock: each request was checked at submission to fit the whole
  cache on its own, and the oldest running sequence is never preempted by a younger
  one, so it always advances.

Shared prompt blocks: the requests of one `group` hold one prompt (a GRPO group's samples).
While a running member holds the prompt's K/V as the prompt's own prefill computes them
(a *holder*: it was admitted with no generated token to recompute), a member admitted next
references the holder's full prompt blocks (`BlockAllocator.share`) instead of new ones,
and gets its own block for the partial last one, into which the engine core copies the
holder's prompt slots (`Sequence.prompt_donor`); it runs no prefill and takes token 0's
logits from the holder (`Sequence.prompt_logits`). A sample never writes into a shared
block: it writes only positions past its prompt, and the shared blocks end before that. So
admission and every check of free blocks count a group's full prompt blocks once. A
preempted member drops its references only; the blocks stay while another member holds
them. A member recomputed with generated tokens prefills into blocks of its own, all of
them: its prompt positions are computed there inside the longer sequence, and its outputs
are those of the same recompute without sharing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .contract import FinishReason, SamplingParams
from .exits import ExitPolicy, exit_policies
from .kv_cache import BlockAllocator, blocks_needed, prompt_blocks, request_blocks
from .request_rng import RequestRng

if TYPE_CHECKING:
    import torch


@dataclass
class Sequence:
    """One request's state. The cache holds K/V for `num_cached` tokens: the prompt, then
    generated tokens 0..n-2; the newest generated token is the next decode input.

    `group`: requests of one call with the same group hold the same prompt and share its full
    KV blocks (module docstring); None shares nothing. `prompt_donor` is the holder whose
    prompt K/V this sequence reuses in the prefill step it was admitted for (None: it prefills);
    `prompt_logits` token 0's logits, kept while it holds its group's prompt."""

    index: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    rng: RequestRng
    max_kv_tokens: int
    text_prompt: str | None = None
    output: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: FinishReason | None = None
    group: int | None = None
    prompt_donor: Sequence | None = field(default=None, repr=False, compare=False)
    prompt_logits: torch.Tensor | None = field(default=None, repr=False, compare=False)
    exit_policies: tuple[ExitPolicy, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.exit_policies = exit_policies(self.params)  # once here, not per row and step

    def exit_policy(self, ahead: int = 0) -> ExitPolicy:
        """The exit policy of this sequence's next decode row; `ahead` 1 when a step in
        flight has already sampled the token that row feeds (not yet emitted)."""
        table = self.exit_policies
        if len(table) == 1:
            return table[0]
        return table[min(len(self.output) + ahead, len(table)) - 1]

    @property
    def prefill_tokens(self) -> list[int]:
        return self.prompt + self.output[:-1]

    def prefill_depths(self, num_loops: int) -> list[int]:
        return [num_loops] * len(self.prompt) + self.depths[1:]

    @property
    def is_fresh(self) -> bool:
        return not self.output

    @property
    def prompt_only(self) -> bool:
        """Whether a prefill of this sequence computes its prompt alone (no generated token to
        recompute): its K/V are then the ones every member of its group gets."""
        return len(self.output) <= 1

    @property
    def lookahead(self) -> int:
        """Draft tokens of this sequence's next speculative step (0 without speculation): at most
        N, and never more than the tokens it may still emit after the verified one."""
        return max(0, min(self.params.speculative_tokens, self.params.max_tokens - len(self.output) - 1))


@dataclass
class StepPlan:
    prefill: list[Sequence]
    decode: list[Sequence]
    preempted: list[Sequence]


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_prefill_tokens: int,
        *,
        reserve: bool = False,
    ) -> None:
        self.allocator, self.block_size = allocator, block_size
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.reserve = reserve
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # per group, its running holders (module docstring), oldest first
        self.holders: dict[int, list[Sequence]] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def activate(self, seq: Sequence) -> None:
        """Run `seq` from the next step without a prefill: its blocks and `num_cached` tokens
        of KV are already in place (a PD decode worker's request, prefilled elsewhere)."""
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        decode, preempted = self._reserve_decode_slots()
        prefill = [] if preempted else self._admit()
        return StepPlan(prefill=prefill, decode=decode, preempted=preempted)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)

    def drain(self) -> list[Sequence]:
        """Remove every sequence (running and waiting), freeing their blocks."""
        seqs = sorted([*self.running, *self.waiting], key=lambda s: s.index)
        for seq in self.running:
            self._release(seq)
        self.running, self.waiting = [], deque()
        return seqs

    def reserve_decode_slots(self, seqs: list[Sequence]) -> bool:
        """Give each of `seqs` (running, not speculating) a slot for its next input token if the
        free blocks allow it without preempting anyone -> whether all got one. (Blocks granted
        before a refusal stay with their sequence, as `schedule` would grant them too.)"""
        return all(self._grow(seq, seq.num_cached + 1) for seq in seqs)

    def may_admit(self, leaving: list[Sequence]) -> bool:
        """Whether the next `schedule` could admit the queue's head once `leaving` (running rows
        about to finish) are released: an upper bound, every block they hold freed and the
        head's full prompt blocks shared. False means it admits nobody for certain."""
        if not self.waiting or len(self.running) - len(leaving) >= self.max_num_seqs:
            return False
        seq = self.waiting[0]
        n = len(seq.prefill_tokens)
        shared = prompt_blocks(len(seq.prompt), self.block_size) if seq.group is not None and seq.prompt_only else 0
        need = blocks_needed(min(n + 1, seq.max_kv_tokens), self.block_size) - shared
        return need <= self.allocator.num_free + sum(len(s.blocks) for s in leaving)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = blocks_needed(num_tokens, self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        seq.blocks += self.allocator.allocate(need)
        return True

    def _release(self, seq: Sequence) -> None:
        """Drop `seq`'s references to its blocks and its place among its group's holders."""
        self.allocator.free(seq.blocks)
        seq.blocks, seq.prompt_donor, seq.prompt_logits = [], None, None
        holders = self.holders.get(seq.group)
        if holders is not None and seq in holders:
            holders.remove(seq)
            if not holders:
                del self.holders[seq.group]

    def _reserve_decode_slots(self) -> tuple[list[Sequence], list[Sequence]]:
        decode: list[Sequence] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if self._grow(seq, seq.num_cached + 1 + seq.lookahead):
                decode.append(seq)
                i += 1
                continue
            victim = self.running[-1]  # youngest first; may be `seq` itself
            self._preempt(victim)
            preempted.append(victim)
        for seq in preempted:  # youngest first, so the oldest ends up at the head
            self.waiting.appendleft(seq)
        return decode, preempted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_cached = 0

    def _donor(self, seq: Sequence) -> Sequence | None:
        """The holder whose prompt blocks `seq` would share, if `seq` may share them."""
        if seq.group is None or not seq.prompt_only:
            return None
        holders = self.holders.get(seq.group)
        return holders[0] if holders else None

    def _most_blocks(self, seq: Sequence) -> int:
        """The most blocks `seq` holds at once (shared ones included), at most the whole cache."""
        most = request_blocks(seq.max_kv_tokens, seq.params.speculative_tokens, self.block_size)
        return min(most, self.allocator.num_blocks)

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        owed = sum(max(0, self._most_blocks(s) - len(s.blocks)) for s in self.running) if self.reserve else 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = len(seq.prefill_tokens)
            if admitted and n > budget:
                break
            donor = self._donor(seq)
            shared = donor.blocks[: prompt_blocks(len(seq.prompt), self.block_size)] if donor is not None else []
            need = blocks_needed(min(n + 1, seq.max_kv_tokens), self.block_size) - len(shared)
            if need > self.allocator.num_free:
                break
            if self.reserve:
                later = max(0, self._most_blocks(seq) - len(shared) - need)
                if owed + need + later > self.allocator.num_free:
                    break
                owed += later
            seq.blocks = self.allocator.share(shared) + self.allocator.allocate(need)
            seq.prompt_donor = donor
            if seq.group is not None and seq.prompt_only:
                self.holders.setdefault(seq.group, []).append(seq)
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
            budget -= n
        return admitted
