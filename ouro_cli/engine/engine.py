"""`LLM`: the in-process rollout engine for Ouro (implements contract.RolloutEngine).

    llm = LLM(model_or_checkpoint, device="cuda", dtype=torch.bfloat16, max_num_seqs=64,
              kv_blocks=4096, block_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=512, temperature=1.0, max_loops=3, logprobs=0))

`LLM` is the user facade over one `EngineCore` (core.py), which owns the model, the
paged per-loop KV cache (kv_cache.py), model execution (runner.py), sampling, emission,
self-speculation (speculative.py) and weight publication (publication.py). The facade
takes requests (frontend.py), views the cache with the planes a call needs, and runs
its requests to completion with continuous batching (scheduler.py), one `core.step` at
a time. `async_scheduling=True` reads exit signals one loop late and forces delayed
exits (async_exits.py). On CUDA decode steps overlap (`overlap`): step n + 1 is queued
on the device's sampled tokens before step n is read back. `generate` itself blocks
until all its requests finished. Other threads may pause it (requests held at a step
boundary, or aborted) and publish weights once it is idle. Every step is a
deterministic function of the requests, their seeds, the weights and the
configuration — never of timing.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from ouro_cli.model import OuroForCausalLM
from ouro_cli.settings import ExecutionSettings, chosen_settings
from ouro_cli.testing.faults import simulated_device_limit

from .contract import (
    EngineBusy,
    GenerateProgress,
    Prompt,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    WeightChunk,
)
from .core import EngineCore
from .frontend import Admission, GenerationControl, make_output, take_requests
from .kv_cache import capacity_blocks, group_blocks, request_blocks
from .request_rng import RequestRng
from .scheduler import Sequence
from .setup import EngineLimits, open_model


class LLM(GenerationControl):
    """The Ouro rollout engine. `model` is a checkpoint path or a loaded OuroForCausalLM.

    `kv_blocks` × `block_size` tokens of KV (each token T planes × L layers) are
    allocated up front; by default enough for `max_num_seqs` sequences of
    min(max_model_len, 2048) tokens. On CUDA decode steps are captured as CUDA graphs
    unless `cuda_graphs=False`; `attn_chunk` is decode attention's chunk length. `seed`
    seeds the draw of per-request seeds for requests that give none (None: fresh
    entropy). `weight_version` names the loaded weights. A checkpoint's tokenizer.json
    (or `tokenizer=`) enables text prompts and output text. `async_scheduling` queues each
    decode loop before reading the previous loop's exit signal; threshold requests then
    run the delayed exit policy (their effective params say so) and speculation is refused.
    `overlap` (default: on CUDA) queues decode step n + 1 before reading step n's tokens
    while the batch stays the same (`EngineCore.decode`); outputs are those of stepping one
    at a time. `core` is the engine core; `model`, `device`, `kv` and `runner` are its parts.
    `execution` (ouro_cli/settings.py) becomes the model's execution settings, which choose
    the decode kernels and the compilation (None: keep the model's own); `exact` turns exact
    mode (docs/exact.md) on or off in them: `LLM(model, exact=True)`.
    `share_prompts` (default on): requests of one call with the same prompt (a GRPO group)
    share its full KV blocks (scheduler.py), so a group's prompt takes its blocks once, in the
    cache a call restores and in every check of free blocks; off, each request holds its own
    copy. The values every request reads are the same either way; a cache too small for a call
    may schedule it differently. `reserve_blocks` (default off): a cache too small for a call
    holds requests back instead of admitting them and later preempting running ones
    (scheduler.py); outputs are those of any schedule (exactly so in exact mode).
    `cascade` (default on): where the Triton decode attention runs, the rows of a step that
    share a prompt's blocks read them once per group and loop instead of once per row
    (engine/cascade.py); every output has the same bits on or off.
    """

    def __init__(
        self,
        model: str | Path | OuroForCausalLM,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_num_seqs: int = 64,
        kv_blocks: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 8192,
        attn_chunk: int = 128,
        cuda_graphs: bool | None = None,
        seed: int | None = None,
        tokenizer=None,
        weight_version: int = 0,
        async_scheduling: bool = False,
        overlap: bool | None = None,
        execution: ExecutionSettings | None = None,
        exact: bool | None = None,
        share_prompts: bool = True,
        reserve_blocks: bool = False,
        cascade: bool = True,
    ) -> None:
        model, self.codec = open_model(model, device=device, dtype=dtype, tokenizer=tokenizer)
        model.execution = chosen_settings(model.execution, execution, exact)
        limits = EngineLimits.resolve(
            model.config,
            max_num_seqs=max_num_seqs,
            kv_blocks=kv_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            max_prefill_tokens=max_prefill_tokens,
        )
        self.core = core = EngineCore(
            model,
            limits,
            attn_chunk=attn_chunk,
            cuda_graphs=cuda_graphs,
            async_exits=async_scheduling,
            weight_version=weight_version,
            reserve_blocks=reserve_blocks,
            cascade=cascade,
        )
        self.model, self.device, self.kv, self.runner = core.model, core.device, core.kv, core.runner  # to inspect
        self.async_scheduling = async_scheduling
        self.share_prompts = share_prompts
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self._seeds = random.Random(seed)
        self.control = Admission(core.publisher)
        self._next_request = 0
        self._kv_limit: int | None = None  # limit_kv_blocks
        self.generate_progress = GenerateProgress()  # contract.ReportsProgress

    # ---- generation ------------------------------------------------------------------

    def generate(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        with self.control.admitted():
            self.kv.set_planes(self._planes_for(params))
            seqs = self._make_sequences(prompts, params)
            # after release_memory(): a cache only as large as these requests can ever fill,
            # and no larger than the limit (limit_kv_blocks)
            blocks, most = self._blocks_for(seqs), self._limit_at_view()
            simulated_device_limit(blocks if most is None else min(blocks, most), self.kv.planes, self.core.num_loops)
            self.core.restore_memory(blocks, most=most)
            version = self.core.publisher.committed_version
            self._run(seqs)
            return [self._output(s, version) for s in seqs]

    def _run(self, seqs: list[Sequence]) -> None:
        sched = self.core.scheduler()
        for seq in seqs:
            sched.add(seq)
        counters, progress = self.core.counters, self.generate_progress
        first = counters.decode_tokens
        progress.sequences, progress.finished, progress.tokens = len(seqs), 0, 0
        progress.max_tokens = sum(seq.params.max_tokens for seq in seqs)
        progress.calls += 1
        try:
            while sched.has_work():
                if self.control.hold_at_step_boundary():
                    for seq in sched.drain():
                        seq.finish_reason = "abort"
                    return
                self.core.step(sched, overlap=self.overlap, hold=self.control.pause_requested)
                progress.finished = len(seqs) - len(sched.running) - len(sched.waiting)
                progress.tokens = counters.decode_tokens - first
        finally:
            sched.drain()  # on any error, give every block back

    def _planes_for(self, params: SamplingParams | Seq[SamplingParams] | None) -> int:
        """KV planes this call reads: its deepest decode budget (K, or a trace's deepest
        entry), or T when any request speculates (verification runs every loop). Invalid
        params fall back to T and are rejected, with their reason, by the request intake."""
        many = params if isinstance(params, Seq) else [params or SamplingParams()]
        deepest = 1
        for p in many:
            if not isinstance(p, SamplingParams) or p.speculative_tokens or p.max_loops is None:
                return self.core.num_loops
            deepest = max(deepest, p.max_loops, *(p.exit_trace or ()))
        return max(1, min(deepest, self.core.num_loops))

    def limit_kv_blocks(self, blocks: int | None) -> None:
        """Every later generate call holds at most `blocks` KV blocks counted at T planes (None:
        the capacity); see contract.LimitsMemory. Takes effect at the call's restore."""
        if blocks is not None and blocks < 1:
            raise ValueError(f"a KV limit must be at least one block, got {blocks}")
        self._kv_limit = blocks

    def min_kv_blocks(self, seq_tokens: int, planes: int) -> int:
        """The fewest blocks at T planes whose view at `planes` planes holds one request of
        `seq_tokens` tokens (prompt + max_tokens) and the scratch block."""
        core = self.core
        need = request_blocks(seq_tokens - 1, 0, core.limits.block_size) + 1
        return -(-need * planes // core.num_loops)

    def _limit_at_view(self) -> int | None:
        """The limit in blocks of the current view (scratch excluded), or None."""
        if self._kv_limit is None:
            return None
        return capacity_blocks(self._kv_limit, self.core.num_loops, self.kv.planes, self.core.limits.block_size)

    def _blocks_for(self, seqs: list[Sequence]) -> int:
        """Blocks of the current view that `seqs` can hold at most at once: each group's full
        prompt blocks once and every request's own blocks (kv_cache.group_blocks)."""
        groups: dict[int, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault(s.index if s.group is None else s.group, []).append(s)
        bs = self.core.limits.block_size
        return sum(
            group_blocks(len(g[0].prompt), [(s.max_kv_tokens, s.params.speculative_tokens) for s in g], bs)
            for g in groups.values()
        )

    def _make_sequences(self, prompts: Seq[Prompt], params) -> list[Sequence]:
        lim = self.core.limits
        intake = take_requests(
            prompts,
            params,
            codec=self.codec,
            vocab_size=self.model.config.vocab_size,
            num_loops=self.core.num_loops,
            seeds=self._seeds,
            first_id=self._next_request,
            max_model_len=lim.max_model_len,
            block_size=lim.block_size,
            kv_blocks=self.kv.blocks_at(self.kv.planes, capacity=True),
            adjust=async_params if self.async_scheduling else None,
        )
        self._next_request += len(intake)
        groups = prompt_groups([r.ids for r in intake]) if self.share_prompts else [None] * len(intake)
        return [
            Sequence(
                index=r.index,
                request_id=r.request_id,
                prompt=r.ids,
                params=r.params,
                rng=RequestRng(r.params.seed),
                max_kv_tokens=r.kv_tokens,
                text_prompt=r.text,
                group=group,
            )
            for r, group in zip(intake, groups, strict=True)
        ]

    def _output(self, seq: Sequence, version: int) -> RequestOutput:
        return make_output(
            request_id=seq.request_id,
            prompt=seq.prompt,
            output=seq.output,
            depths=seq.depths,
            logprobs=seq.logprobs,
            finish_reason=seq.finish_reason,
            params=seq.params,
            version=version,
            codec=self.codec,
            text_prompt=seq.text_prompt,
        )

    # ---- weight publication -------------------------------------------------------------

    def start_weight_update(self, version: int) -> None:
        with self.control.lock:
            self.control.check_idle_for_update()
            self.core.start_weight_update(version)

    def update_weights(self, chunk: WeightChunk) -> None:
        with self.control.lock:
            self.control.check_open()
            self.core.update_weights(chunk)

    def finish_weight_update(self) -> None:
        with self.control.lock:
            self.control.check_open()
            self.core.finish_weight_update()

    def get_weight_version(self) -> int:
        return self.core.publisher.committed_version

    # ---- memory hand-back (contract.ReleasesMemory) ---------------------------------------

    def release_memory(self) -> None:
        """Free the KV cache while the engine is idle (its CUDA graphs are kept for its return)."""
        with self.control.lock:
            self.control.check_open()
            if self.control.generating:
                raise EngineBusy("release_memory() while generate is running")
            self.core.release_memory()

    def restore_memory(self) -> None:
        """Allocate the KV cache again (zeroed), the whole capacity."""
        with self.control.lock:
            self.control.check_open()
            self.core.restore_memory()

    # ---- misc ---------------------------------------------------------------------------

    def work_counters(self) -> Mapping[str, int]:
        return self.core.work_counters()

    def take_decode_batches(self) -> list[int]:
        """The rows of every decode step since the last call, in order (the batch over time), and
        forget them. Not part of the engine contract: a run reads it where an engine has it."""
        batches = list(self.core.runner.batches)
        self.core.runner.batches.clear()
        return batches

    def close(self) -> None:
        control = self.control
        with control.lock:
            if control.generating:
                raise EngineBusy("close() while generate is running; pause with abort=True first")
            if control.closed:
                return
            control.closed = True
            self.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prompt_groups(prompts: list[list[int]]) -> list[int | None]:
    """Each request's group (scheduler.Sequence.group): the index of the first request with the
    same prompt, or None for a prompt no other request of the call holds."""
    keys = [tuple(p) for p in prompts]
    first: dict[tuple[int, ...], int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    counts = Counter(keys)
    return [first[key] if counts[key] > 1 else None for key in keys]


def async_params(params: SamplingParams, index: int) -> SamplingParams:
    """The effective params of request `index` on an asynchronously scheduling engine: threshold
    exits act one loop late ("delayed"); speculation, which needs synchronous steps, is refused."""
    if params.speculative_tokens:
        raise RequestRejected(
            f"request {index}: speculative_tokens needs synchronous scheduling; this engine was "
            "built with async_scheduling=True"
        )
    if params.exit_mode == "immediate" and params.exit_threshold < 1.0:
        return dataclasses.replace(params, exit_mode="delayed")
    return params
