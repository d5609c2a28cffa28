"""`EngineCore`: one engine's model, KV cache, runner and weights, and the steps that advance requests.

Everything that runs the engine drives this core through its public step methods:

- `LLM` (engine.py), the user facade, takes requests, holds them at step boundaries for
  pause and abort, and calls `step` until its scheduler is empty;
- the PD decode worker (pd/worker.py) activates requests whose KV another process
  prefilled (`Scheduler.activate`), samples their token 0 with `sample` and calls `step`;
  the PD prefill worker prefills into its own blocks with `runner.prefill`;
- self-speculation (speculative.py), which the core runs for the sequences that
  speculate, decodes through `runner.decode` and emits through `emit`.

One `step`: the scheduler's plan, then `prefill` of the admitted sequences (token 0 of
each fresh one sampled from its last prompt position) and `decode` of the running ones.
A decode step is `launch_decode` (queue the step and the sampling of its tokens) then
`finish_step` (read the tokens back, the step's one device-to-host wait, and `emit`
them); with overlap the next step is queued before that wait. Every step is a
deterministic function of the requests, their seeds, the weights and the configuration,
never of timing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn

from ouro_cli.host_to_device import HostCopy, to_device
from ouro_cli.model import fuse_projections
from ouro_cli.settings import executing

from .contract import EngineError, WeightChunk
from .kv_cache import PagedKVCache, prompt_blocks
from .publication import WeightPublisher
from .runner import ModelRunner, PrefillItem, WorkCounters
from .sampling import SamplingBatch, processed_logprobs, raw_logprobs, sample, token_logprobs
from .scheduler import Scheduler, Sequence, StepPlan
from .setup import EngineLimits, eos_token_ids
from .speculative import Speculator
from .step_timing import StepSpans


@dataclasses.dataclass
class DecodeStep:
    """A queued step's sampled tokens: `tokens` [B] on the device (the next step's inputs),
    `host` their copy with logprobs and depths on the way back; `depths` when already known."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    host: HostCopy
    depths: list[int] | None
    spans: StepSpans | None = None  # the device time of its forward and sampling (CUDA)


class EngineCore:
    """The model (put in eval mode; its projections fused on CUDA), a paged per-loop KV
    cache of `limits.kv_blocks` blocks, the model runner, the work counters, the weight
    publisher and the EOS set, and the step methods that use them.

    `attn_chunk` is decode attention's chunk length; on CUDA decode steps are captured as
    CUDA graphs unless `cuda_graphs=False`; `async_exits` reads exit signals one loop late
    (async_exits.py); `weight_version` names the loaded weights; `reserve_blocks` makes its
    schedulers admit a request only with room for every block it may come to hold (scheduler.py);
    `cascade` lets the Triton decode attention read a prefix that rows share once per group
    (engine/cascade.py; the same bits either way).
    The core keeps no request state between calls: sequences live in the `Scheduler` the caller
    passes to each step.
    """

    def __init__(
        self,
        model: nn.Module,
        limits: EngineLimits,
        *,
        attn_chunk: int = 128,
        cuda_graphs: bool | None = None,
        async_exits: bool = False,
        weight_version: int = 0,
        reserve_blocks: bool = False,
        cascade: bool = True,
    ) -> None:
        model.eval()
        if next(model.parameters()).is_cuda:
            # fewer, wider GEMMs per decode loop (model/fusion.py). Exact mode too: its fixed-tile
            # kernel gives an output column the bits of that column's weight row and the input
            # row alone, so [q;k;v] and [gate;up] multiply to the trainer's separate products'
            # bits (docs/exact.md §2; tests/unit/engine/_fixed_tile_checks.py check_fused_columns)
            fuse_projections(model)
        self.model, self.limits = model, limits
        cfg = model.config
        self.num_loops = cfg.total_ut_steps
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        model.execution.check_model_dtype(self.dtype == torch.bfloat16)
        self.kv = PagedKVCache(
            num_layers=cfg.num_hidden_layers,
            num_loops=self.num_loops,
            num_blocks=limits.kv_blocks,
            block_size=limits.block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.dim_per_head,
            dtype=self.dtype,
            device=self.device,
            fp8=model.execution.fp8_kv,
        )
        self.counters = WorkCounters()
        self.runner = ModelRunner(
            model,
            self.kv,
            self.counters,
            attn_chunk,
            cuda_graphs=self.device.type == "cuda" if cuda_graphs is None else cuda_graphs,
            async_exits=async_exits,
            cascade=cascade,
        )
        self.speculator = Speculator(self.runner, self.counters, self.emit)
        self.publisher = WeightPublisher(model, weight_version)
        self.eos_token_ids = eos_token_ids(cfg)
        self.reserve_blocks = reserve_blocks

    def scheduler(self) -> Scheduler:
        """A scheduler over the cache's current blocks (make it after `kv.set_planes`) and the limits."""
        lim = self.limits
        return Scheduler(
            self.kv.allocator, lim.block_size, lim.max_num_seqs, lim.max_prefill_tokens, reserve=self.reserve_blocks
        )

    # ---- steps --------------------------------------------------------------------------

    def step(self, sched: Scheduler, *, overlap: bool = False, hold: Callable[[], bool] | None = None) -> StepPlan:
        """One scheduler step: plan it, prefill the admitted sequences, decode the running ones
        (`decode`'s `overlap` and `hold`). -> the plan that ran."""
        plan = sched.schedule()
        self.counters.preemptions += len(plan.preempted)
        if not plan.prefill and not plan.decode:
            raise EngineError(
                f"the scheduler could not make progress (this is a bug): running "
                f"{[(q.request_id, q.num_cached, len(q.blocks)) for q in sched.running]}, waiting "
                f"{[q.request_id for q in sched.waiting]}, {self.kv.allocator.num_free} blocks free"
            )
        if plan.prefill:
            start = time.perf_counter()  # the prefill ends waiting for its first tokens: its whole time
            self.prefill(plan.prefill, sched)
            self.counters.prefill_us += round((time.perf_counter() - start) * 1e6)
        if plan.decode:
            self.decode(plan.decode, sched, overlap=overlap, hold=hold)
        return plan

    def prefill(self, seqs: list[Sequence], sched: Scheduler) -> None:
        """Prefill the admitted sequences, each computed once per distinct (tokens, depths), in
        groups of one width where they are fresh prompts (`ModelRunner.prefill_many`), and
        sample token 0 of each fresh one (a recomputed sequence already holds its next input).

        A GRPO group submits its prompt G times. A member the scheduler admitted beside a holder
        of its prompt (`Sequence.prompt_donor`, scheduler.py) shares the holder's full prompt
        blocks already; it receives the holder's slots of the partial last block by a slot copy
        and token 0's logits from the holder, and runs nothing. Other copies of one (tokens,
        depths) admitted in one step share one prefill and receive its K/V (every layer and
        plane) the same way. All copies go at once, queued after the prefills they copy from.
        Prefill is deterministic, so this gives the bits a separate prefill would."""
        items: list[PrefillItem] = []
        computed_by: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        sources: dict[int, int] = {}  # id(sequence) -> the item that computes it
        copy_from: list[int] = []
        copy_to: list[int] = []
        for seq in seqs:
            tokens, depths = seq.prefill_tokens, seq.prefill_depths(self.num_loops)
            seq.num_cached = len(tokens)
            donor = seq.prompt_donor
            if donor is not None:  # its full prompt blocks are the donor's: copy the rest of the prompt
                start = prompt_blocks(len(tokens), self.kv.block_size) * self.kv.block_size
                copy_from += self.kv.slots(donor.blocks, start, len(tokens))
                copy_to += self.kv.slots(seq.blocks, start, len(tokens))
                self.counters.prefill_tokens_shared += len(tokens)
                continue
            slots = self.kv.slots(seq.blocks, 0, len(tokens))
            key = (tuple(tokens), tuple(depths))
            if key in computed_by:
                copy_from += items[computed_by[key]].slots
                copy_to += slots
                self.counters.prefill_tokens_shared += len(tokens)
            else:
                computed_by[key] = len(items)
                items.append(PrefillItem(tokens, depths, slots))
            sources[id(seq)] = computed_by[key]
        last = self.runner.prefill_many(items)
        for seq in seqs:  # donors first: a member admitted beside one takes its logits below
            if id(seq) in sources and seq.group is not None and seq.prompt_only:
                seq.prompt_logits = last[sources[id(seq)]]
        for seq in seqs:
            if seq.prompt_donor is not None:
                seq.prompt_logits, seq.prompt_donor = seq.prompt_donor.prompt_logits, None
        if copy_to:  # every copy at once, queued after the prefills it copies from
            self.kv.copy_slots(copy_from, copy_to)
        fresh = [seq for seq in seqs if seq.is_fresh]
        if fresh:
            logits = [last[sources[id(s)]] if id(s) in sources else s.prompt_logits for s in fresh]
            self.sample(fresh, torch.stack(logits), [self.num_loops] * len(fresh), sched)

    def decode(
        self, seqs: list[Sequence], sched: Scheduler, *, overlap: bool = False, hold: Callable[[], bool] | None = None
    ) -> None:
        """Decode one token for each of `seqs` (those that speculate: one speculative step).

        With `overlap`, keep decoding while the batch stays as it is, queueing step n + 1
        (fed the device's sampled tokens) before reading step n's tokens back: the host's
        per-step work (emitting, scheduling, building the next inputs) runs while the device
        computes, instead of between two steps; `hold()` True (a pause asked for) ends the
        run at the next step. A sequence that ends at step n (a stop token) has then also
        run step n + 1: that row is discarded (`decode_rows_discarded`); it computed with
        its own KV blocks and seed stream only, so no other row sees it. Returns with no
        step in flight."""
        speculative = [s for s in seqs if s.params.speculative_tokens]
        if speculative:
            self.speculator.step(speculative, sched)
            seqs = [s for s in seqs if not s.params.speculative_tokens]
            if not seqs:
                return
            overlap = False  # the speculating sequences wait for the next schedule
        step = self.launch_decode(seqs)
        while step is not None:
            follow = None
            try:
                follow = self._follow_on(step, sched, hold) if overlap else None
            finally:
                self.finish_step(step, sched)
            step = follow

    def launch_decode(self, seqs: list[Sequence], fed: DecodeStep | None = None) -> DecodeStep:
        """Queue a decode step of `seqs` and its sampling. Inputs are each row's last token,
        or with `fed` the tokens `fed` sampled (not yet emitted: one token ahead)."""
        ahead = 0 if fed is None else 1
        if fed is None:
            tokens: list[int] | tuple[torch.Tensor, list[int]] = [s.output[-1] for s in seqs]
        else:
            row = {id(s): i for i, s in enumerate(fed.seqs)}
            tokens = (fed.tokens, [row[id(s)] for s in seqs])
            self.counters.decode_steps_overlapped += 1
        spans = StepSpans.begin(self.device)
        logits, depths = self.runner.decode(
            tokens,
            [s.num_cached for s in seqs],
            [s.blocks for s in seqs],
            [s.exit_policy(ahead) for s in seqs],
            reach=max(s.max_kv_tokens for s in seqs),
        )
        for seq in seqs:
            seq.num_cached += 1
        if spans is not None:
            spans.mark()
        step = self.launch_sample(seqs, logits, depths)
        if spans is not None:
            spans.mark()
            step.spans = spans
        return step

    def _follow_on(self, step: DecodeStep, sched: Scheduler, hold: Callable[[], bool] | None) -> DecodeStep | None:
        """Queue the step after `step` (whose tokens are not yet read) when the batch would not
        change, that is when the next schedule would decode the same rows and admit nobody: no
        hold is asked for, nobody runs outside the step (a sequence admitted while it was
        queued), every continuing row gets its KV slot without preempting anyone, and the queue's
        head could not be admitted even with the rows that end at `step` by length gone
        (`Scheduler.may_admit`: a full batch, or too few blocks). Rows that end at `step` by
        length are left out; rows that end on a stop token cannot be known yet (they run one
        discarded row)."""
        if hold is not None and hold():
            return None
        in_step = {id(s) for s in step.seqs}
        if any(id(s) not in in_step for s in sched.running):
            return None
        live = [s for s in step.seqs if s.finish_reason is None]
        seqs = [s for s in live if len(s.output) + 1 < s.params.max_tokens]
        if not seqs or not sched.reserve_decode_slots(seqs):
            return None
        leaving = [s for s in live if len(s.output) + 1 >= s.params.max_tokens]
        if sched.may_admit(leaving):
            return None
        return self.launch_decode(seqs, fed=step)

    def sample(
        self, seqs: list[Sequence], logits: torch.Tensor, depths: torch.Tensor | list[int], sched: Scheduler
    ) -> list[int]:
        """Sample each row's next token from `logits` [B, V] and emit it; `depths` [B] may still be
        on the device (a decode step's): it comes back with the tokens in one transfer.
        -> the depths."""
        return self.finish_step(self.launch_sample(seqs, logits, depths), sched)

    def launch_sample(self, seqs: list[Sequence], logits: torch.Tensor, depths: torch.Tensor | list[int]) -> DecodeStep:
        """Queue the sampling of each row's next token and its copy to the host."""
        ps = [s.params for s in seqs]
        batch = SamplingBatch(
            [p.temperature for p in ps],
            [p.top_k for p in ps],
            [p.top_p for p in ps],
            [s.rng for s in seqs],
            self.device,
        )
        with executing(self.model.execution):  # the logprobs in the trainer's order (exact mode)
            processed = processed_logprobs(logits, batch)
            raw = raw_logprobs(logits) if any(p.logprobs_mode == "raw" for p in ps) else None
        tokens = sample(processed, batch)
        chosen = token_logprobs(processed, tokens, batch)
        if raw is not None:
            raw = raw.gather(1, tokens[:, None]).squeeze(1)
            use_raw = to_device([p.logprobs_mode == "raw" for p in ps], torch.bool, chosen.device)
            chosen = torch.where(use_raw, raw, chosen)
        on_device = isinstance(depths, torch.Tensor)
        rows = [tokens.double(), chosen.double()] + ([depths.double()] if on_device else [])
        return DecodeStep(seqs, tokens, HostCopy(torch.stack(rows)), None if on_device else list(depths))

    def finish_step(self, step: DecodeStep, sched: Scheduler) -> list[int]:
        """Wait for `step`'s tokens (the step's one device-to-host wait) and emit them; rows
        of sequences that already ended are discarded. -> the depths."""
        start = time.perf_counter()
        host = step.host.values()
        self.counters.token_wait_us += round((time.perf_counter() - start) * 1e6)
        if step.spans is not None:
            forward_us, sample_us = step.spans.elapsed_us()
            self.counters.decode_forward_gpu_us += forward_us
            self.counters.decode_sample_gpu_us += sample_us
        depths = [int(d) for d in host[2]] if step.depths is None else step.depths
        emitted = 0
        for seq, token, depth, lp in zip(step.seqs, host[0], depths, host[1], strict=True):
            if seq.finish_reason is not None:  # ended at the step before (overlap): run, not emitted
                self.counters.decode_rows_discarded += 1
                self.counters.decode_tokens -= 1
                continue
            self.emit(seq, int(token), depth, lp, sched)
            emitted += depth
        if step.depths is None:
            self.counters.decode_layer_tokens += emitted * self.runner.num_layers
        return depths

    def emit(self, seq: Sequence, token: int, depth: int, logprob: float, sched: Scheduler) -> bool:
        """Append one generated token; finish the sequence on a stop token or at max_tokens (-> True)."""
        seq.output.append(token)
        seq.depths.append(depth)
        seq.logprobs.append(logprob)
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            seq.finish_reason = "stop"
        elif len(seq.output) >= p.max_tokens:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            sched.finish(seq)
            return True
        return False

    # ---- weights and memory (the caller checks the core is idle) --------------------------

    def start_weight_update(self, version: int) -> None:
        self.publisher.start(version)
        self.kv.invalidate()  # cached KV belongs to the old weights

    def update_weights(self, chunk: WeightChunk) -> None:
        self.publisher.update(chunk)

    def finish_weight_update(self) -> None:
        self.publisher.finish()

    def release_memory(self) -> None:
        """Free the KV cache. The CUDA graphs captured on it are kept: they replay again when the
        cache comes back with the layout they were captured on (kv_memory.py)."""
        self.kv.release()

    def restore_memory(self, blocks: int | None = None, most: int | None = None) -> None:
        """Allocate the KV cache again (zeroed). With `blocks`: room for that many blocks of the
        current view (rounded up: kv_cache.restore_blocks), at most the capacity and at most
        `most`; a cache allocated smaller than that, or larger than `most`, is allocated again
        (nothing is cached between calls that could be lost: the core is idle)."""
        if most is not None:
            blocks = min(most, self.kv.blocks_at(self.kv.planes, capacity=True) if blocks is None else blocks)
        if blocks is not None and not self.kv.released:
            wanted = min(blocks, self.kv.blocks_at(self.kv.planes, capacity=True))
            held = self.kv.num_blocks
            if held >= wanted and (most is None or held <= most):
                return
            self.release_memory()
        self.kv.restore(blocks, most=most)

    def close(self) -> None:
        """Drop the captured steps and free the cache now, not when the core is collected."""
        self.runner.close()
        self.kv.close()

    def work_counters(self) -> dict[str, int]:
        return self.counters.as_dict()
