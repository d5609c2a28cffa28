"""`LLM`: the in-process rollout engine for Ouro (implements contract.RolloutEngine).

    llm = LLM(model_or_checkpoint, device="cuda", dtype=torch.bfloat16, max_num_seqs=64,
              kv_blocks=4096, block_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=512, temperature=1.0, max_loops=3, logprobs=0))

One `generate` call runs its requests to completion with continuous batching
(scheduler.py) over a paged, per-loop KV cache (kv_cache.py); model execution is
runner.py, exits exits.py, sampling sampling.py, weight updates publication.py.
Requests with `speculative_tokens` decode by self-speculation (speculative.py);
`async_scheduling=True` reads exit signals one loop late and forces delayed exits
(async_exits.py). On CUDA decode steps overlap (`overlap`): step n + 1 is queued on
the device's sampled tokens before step n is read back. `generate` itself blocks
until all its requests finished. Other threads may pause it (requests held at a step
boundary, or aborted) and publish weights once it is idle. Every step is a
deterministic function of the requests, their seeds, the weights and the
configuration — never of timing.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from torch import nn

from ouro_cli.model import OuroForCausalLM, fuse_projections
from ouro_cli.settings import ExecutionSettings

from .contract import (
    EngineBusy,
    EngineError,
    Prompt,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    WeightChunk,
)
from .exits import row_policy
from .frontend import GenerationControl, make_output, take_requests
from .host_to_device import HostCopy, to_device
from .kv_cache import PagedKVCache, blocks_needed
from .publication import WeightPublisher
from .request_rng import RequestRng
from .runner import ModelRunner, PrefillItem, WorkCounters
from .sampling import SamplingBatch, processed_logprobs, raw_logprobs, sample, token_logprobs
from .scheduler import Scheduler, Sequence
from .speculative import Speculator
from .tokenizer import TextCodec

DEFAULT_CONTEXT_PER_SEQ = 2048  # sizes the default KV cache: max_num_seqs sequences of this length


@dataclasses.dataclass
class _Step:
    """A queued step's sampled tokens: `tokens` [B] on the device (the next step's inputs),
    `host` their copy with logprobs and depths on the way back; `depths` when already known."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    host: HostCopy
    depths: list[int] | None


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
    while the batch stays the same (`_decode`); outputs are those of stepping one at a time.
    `execution` (ouro_cli/settings.py) becomes the model's execution settings, which choose
    the decode kernels and the compilation (None: keep the model's own).
    """

    def __init__(self, model: str | Path | OuroForCausalLM, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, max_num_seqs: int = 64, kv_blocks: int | None = None,
                 block_size: int = 16, max_model_len: int | None = None, max_prefill_tokens: int = 8192,
                 attn_chunk: int = 128, cuda_graphs: bool | None = None, seed: int | None = None,
                 tokenizer=None, weight_version: int = 0, async_scheduling: bool = False,
                 overlap: bool | None = None, execution: ExecutionSettings | None = None) -> None:
        codec = TextCodec(tokenizer) if tokenizer is not None else None
        if isinstance(model, (str, Path)):
            from ouro_cli.checkpoint import open_checkpoint
            from ouro_cli.model import load

            model_path = Path(model)
            model = load(model_path, dtype=dtype, device=device or "cpu")
            codec = codec or TextCodec.from_dir(open_checkpoint(model_path).assets_dir)  # HF dir or hf_assets/
        elif device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a checkpoint path or an OuroForCausalLM, got {type(model).__name__}")
        if execution is not None:
            model.execution = execution
        if max_num_seqs < 1 or block_size < 1 or max_prefill_tokens < 1:
            raise ValueError("max_num_seqs, block_size and max_prefill_tokens must be >= 1")
        model.eval()
        if next(model.parameters()).is_cuda:
            fuse_projections(model)  # fewer, wider GEMMs per decode loop (model/fusion.py)
        self.model = model
        self.codec = codec
        cfg = model.config
        self.num_loops = cfg.total_ut_steps
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.max_num_seqs, self.block_size, self.max_prefill_tokens = max_num_seqs, block_size, max_prefill_tokens
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if kv_blocks is None:
            kv_blocks = max_num_seqs * blocks_needed(min(self.max_model_len, DEFAULT_CONTEXT_PER_SEQ), block_size)
        self.kv = PagedKVCache(num_layers=cfg.num_hidden_layers, num_loops=self.num_loops, num_blocks=kv_blocks,
                               block_size=block_size, num_kv_heads=cfg.num_key_value_heads,
                               head_dim=cfg.dim_per_head, dtype=self.dtype, device=self.device)
        self.counters = WorkCounters()
        self.async_scheduling = async_scheduling
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.runner = ModelRunner(model, self.kv, self.counters, attn_chunk,
                                  cuda_graphs=self.device.type == "cuda" if cuda_graphs is None else cuda_graphs,
                                  async_exits=async_scheduling)
        self.speculator = Speculator(self)
        self.publisher = WeightPublisher(model, weight_version)
        eos = cfg.eos_token_id
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self._seeds = random.Random(seed)
        self._init_control()
        self._next_request = 0

    # ---- generation ------------------------------------------------------------------

    def generate(self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        with self._admitted():
            self.kv.restore()  # a no-op unless release_memory() handed the cache back
            self.kv.set_planes(self._planes_for(params))
            seqs = self._make_sequences(prompts, params)
            version = self.publisher.committed_version
            self._run(seqs)
            return [self._output(s, version) for s in seqs]

    def _run(self, seqs: list[Sequence]) -> None:
        sched = Scheduler(self.kv.allocator, self.block_size, self.max_num_seqs, self.max_prefill_tokens)
        for seq in seqs:
            sched.add(seq)
        try:
            while sched.has_work():
                if self._hold_at_step_boundary():
                    for seq in sched.drain():
                        seq.finish_reason = "abort"
                    return
                plan = sched.schedule()
                self.counters.preemptions += len(plan.preempted)
                if not plan.prefill and not plan.decode:
                    raise EngineError("the scheduler could not make progress (this is a bug)")
                if plan.prefill:
                    self._prefill(plan.prefill, sched)
                if plan.decode:
                    self._decode(plan.decode, sched, overlap=self.overlap)
        finally:
            sched.drain()  # on any error, give every block back

    def _prefill(self, seqs: list[Sequence], sched: Scheduler) -> None:
        """Prefill the admitted sequences, each computed once per distinct (tokens, depths).

        A GRPO group submits its prompt G times; the copies admitted in one step share one
        prefill, and the others receive its K/V (every layer and plane) by a slot copy.
        Prefill is deterministic, so this gives the bits a separate prefill would."""
        fresh, logits = [], []
        done: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[list[int], torch.Tensor]] = {}
        for seq in seqs:
            tokens, depths = seq.prefill_tokens, seq.prefill_depths(self.num_loops)
            slots = self.kv.slots(seq.blocks, 0, len(tokens))
            key = (tuple(tokens), tuple(depths))
            if key in done:
                source_slots, last = done[key]
                self.kv.copy_slots(source_slots, slots)
                self.counters.prefill_tokens_shared += len(tokens)
            else:
                last = self.runner.prefill(PrefillItem(tokens, depths, slots))
                done[key] = (slots, last)
            seq.num_cached = len(tokens)
            if seq.is_fresh:  # a recomputed sequence already holds its next input token
                fresh.append(seq)
                logits.append(last)
        if fresh:
            self._sample(fresh, torch.stack(logits), [self.num_loops] * len(fresh), sched)

    def _decode(self, seqs: list[Sequence], sched: Scheduler, overlap: bool = False) -> None:
        """Decode one token for each of `seqs`. With `overlap`, keep decoding while the batch
        stays as it is, queueing step n + 1 (fed the device's sampled tokens) before reading
        step n's tokens back: the host's per-step work (emitting, scheduling, building the
        next inputs) runs while the device computes, instead of between two steps. A
        sequence that ends at step n (a stop token) has then also run step n + 1: that row
        is discarded (`decode_rows_discarded`); it computed with its own KV blocks and
        seed stream only, so no other row sees it. Returns with no step in flight."""
        speculative = [s for s in seqs if s.params.speculative_tokens]
        if speculative:
            self.speculator.step(speculative, sched)
            seqs = [s for s in seqs if not s.params.speculative_tokens]
            if not seqs:
                return
            overlap = False  # the speculating sequences wait for the next schedule
        step = self._launch_decode(seqs)
        while step is not None:
            follow = None
            try:
                follow = self._follow_on(step, sched) if overlap else None
            finally:
                self._finish_step(step, sched)
            step = follow

    def _launch_decode(self, seqs: list[Sequence], fed: _Step | None = None) -> _Step:
        """Queue a decode step of `seqs` and its sampling. Inputs are each row's last token,
        or with `fed` the tokens `fed` sampled (not yet emitted: one token ahead)."""
        ahead = 0 if fed is None else 1
        if fed is None:
            tokens: list[int] | tuple[torch.Tensor, list[int]] = [s.output[-1] for s in seqs]
        else:
            row = {id(s): i for i, s in enumerate(fed.seqs)}
            tokens = (fed.tokens, [row[id(s)] for s in seqs])
            self.counters.decode_steps_overlapped += 1
        logits, depths = self.runner.decode(tokens, [s.num_cached for s in seqs], [s.blocks for s in seqs],
                                            [row_policy(s.params, len(s.output) + ahead) for s in seqs])
        for seq in seqs:
            seq.num_cached += 1
        return self._launch_sample(seqs, logits, depths)

    def _follow_on(self, step: _Step, sched: Scheduler) -> _Step | None:
        """Queue the step after `step` (whose tokens are not yet read) when the batch would not
        change: nothing waits to be admitted (or the batch is full), no pause is asked for,
        and every continuing row gets its KV slot without preempting anyone. Rows that end
        at `step` by length are left out; rows that end on a stop token cannot be known yet."""
        if (sched.waiting and len(sched.running) < sched.max_num_seqs) or self._pause_requested():
            return None
        seqs = [s for s in step.seqs if s.finish_reason is None and len(s.output) + 1 < s.params.max_tokens]
        if not seqs or not sched.reserve_decode_slots(seqs):
            return None
        return self._launch_decode(seqs, fed=step)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, depths: torch.Tensor | list[int],
                sched: Scheduler) -> list[int]:
        """Sample each row's next token and emit it; `depths` [B] may still be on the device
        (a decode step's): it comes back with the tokens in one transfer. -> the depths."""
        return self._finish_step(self._launch_sample(seqs, logits, depths), sched)

    def _launch_sample(self, seqs: list[Sequence], logits: torch.Tensor, depths: torch.Tensor | list[int]) -> _Step:
        """Queue the sampling of each row's next token and its copy to the host."""
        ps = [s.params for s in seqs]
        batch = SamplingBatch([p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                              [s.rng for s in seqs], self.device)
        processed = processed_logprobs(logits, batch)
        tokens = sample(processed, batch)
        chosen = token_logprobs(processed, tokens, batch)
        if any(p.logprobs_mode == "raw" for p in ps):
            raw = raw_logprobs(logits).gather(1, tokens[:, None]).squeeze(1)
            use_raw = to_device([p.logprobs_mode == "raw" for p in ps], torch.bool, chosen.device)
            chosen = torch.where(use_raw, raw, chosen)
        on_device = isinstance(depths, torch.Tensor)
        rows = [tokens.double(), chosen.double()] + ([depths.double()] if on_device else [])
        return _Step(seqs, tokens, HostCopy(torch.stack(rows)), None if on_device else list(depths))

    def _finish_step(self, step: _Step, sched: Scheduler) -> list[int]:
        """Wait for `step`'s tokens (the step's one device-to-host wait) and emit them; rows
        of sequences that already ended are discarded. -> the depths."""
        host = step.host.values()
        depths = [int(d) for d in host[2]] if step.depths is None else step.depths
        emitted = 0
        for seq, token, depth, lp in zip(step.seqs, host[0], depths, host[1], strict=True):
            if seq.finish_reason is not None:  # ended at the step before (overlap): run, not emitted
                self.counters.decode_rows_discarded += 1
                self.counters.decode_tokens -= 1
                continue
            self._emit(seq, int(token), depth, lp, sched)
            emitted += depth
        if step.depths is None:
            self.counters.decode_layer_tokens += emitted * self.runner.num_layers
        return depths

    def _emit(self, seq: Sequence, token: int, depth: int, logprob: float, sched: Scheduler) -> bool:
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

    def _planes_for(self, params: SamplingParams | Seq[SamplingParams] | None) -> int:
        """KV planes this call reads: its deepest decode budget (K, or a trace's deepest
        entry), or T when any request speculates (verification runs every loop). Invalid
        params fall back to T and are rejected, with their reason, by the request intake."""
        many = params if isinstance(params, Seq) else [params or SamplingParams()]
        deepest = 1
        for p in many:
            if not isinstance(p, SamplingParams) or p.speculative_tokens or p.max_loops is None:
                return self.num_loops
            deepest = max(deepest, p.max_loops, *(p.exit_trace or ()))
        return max(1, min(deepest, self.num_loops))

    def _make_sequences(self, prompts: Seq[Prompt], params) -> list[Sequence]:
        intake = take_requests(prompts, params, codec=self.codec, vocab_size=self.model.config.vocab_size,
                               num_loops=self.num_loops, seeds=self._seeds, first_id=self._next_request,
                               max_model_len=self.max_model_len, block_size=self.block_size,
                               kv_blocks=self.kv.num_blocks,
                               adjust=async_params if self.async_scheduling else None)
        self._next_request += len(intake)
        return [Sequence(index=r.index, request_id=r.request_id, prompt=r.ids, params=r.params,
                         rng=RequestRng(r.params.seed),
                         max_kv_tokens=r.kv_tokens, text_prompt=r.text) for r in intake]

    def _output(self, seq: Sequence, version: int) -> RequestOutput:
        return make_output(request_id=seq.request_id, prompt=seq.prompt, output=seq.output, depths=seq.depths,
                           logprobs=seq.logprobs, finish_reason=seq.finish_reason, params=seq.params,
                           version=version, codec=self.codec, text_prompt=seq.text_prompt)

    # ---- weight publication -------------------------------------------------------------

    def start_weight_update(self, version: int) -> None:
        with self._cond:
            self._check_idle_for_update()
            self.publisher.start(version)
            self.kv.invalidate()  # cached KV belongs to the old weights

    def update_weights(self, chunk: WeightChunk) -> None:
        with self._cond:
            self._check_open()
            self.publisher.update(chunk)

    def finish_weight_update(self) -> None:
        with self._cond:
            self._check_open()
            self.publisher.finish()

    def get_weight_version(self) -> int:
        return self.publisher.committed_version

    # ---- memory hand-back (contract.ReleasesMemory) ---------------------------------------

    def release_memory(self) -> None:
        """Free the KV cache (and the CUDA graphs captured on it) while the engine is idle."""
        with self._cond:
            self._check_open()
            if self._generating:
                raise EngineBusy("release_memory() while generate is running")
            self.kv.release()
            self.runner.drop_graphs()

    def restore_memory(self) -> None:
        """Allocate the KV cache again (zeroed); decode steps are captured again on first use."""
        with self._cond:
            self._check_open()
            self.kv.restore()

    # ---- misc ---------------------------------------------------------------------------

    def work_counters(self) -> Mapping[str, int]:
        return self.counters.as_dict()

    def close(self) -> None:
        with self._cond:
            if self._generating:
                raise EngineBusy("close() while generate is running; pause with abort=True first")
            if self._closed:
                return
            self._closed = True
            self.runner.graphs, self.runner.graph_pool = None, None
            self.kv.release()  # the cache memory goes now, not when the engine is collected

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def async_params(params: SamplingParams, index: int) -> SamplingParams:
    """The effective params of request `index` on an asynchronously scheduling engine: threshold
    exits act one loop late ("delayed"); speculation, which needs synchronous steps, is refused."""
    if params.speculative_tokens:
        raise RequestRejected(f"request {index}: speculative_tokens needs synchronous scheduling; this engine was "
                              "built with async_scheduling=True")
    if params.exit_mode == "immediate" and params.exit_threshold < 1.0:
        return dataclasses.replace(params, exit_mode="delayed")
    return params
