"""`PDEngine`: the rollout-engine contract served by spawned prefill and decode workers.

The coordinator lives in the trainer process. It validates requests exactly as the
local `LLM` does (same seeds drawn, same rejections), then drives each through the
protocol in protocol.py: a decode worker (D) reserves KV blocks, a prefill worker (P)
prefills at full depth and WRITEs the K/V planes and token 0's logits into them over
the KV transport, D activates (after checking the bytes arrived), samples and streams
tokens back; both release. Every worker computes with the same model code and its own
copy of the weights, and decode attention is batch-invariant, so outputs equal the
local engine's bit for bit (token ids, exit depths, log-probabilities).

Failure is loud and bounded: a worker that exits, raises or stays silent for
`timeout` seconds while it owes an answer makes the call raise `WorkerFailed` naming
the worker and the reason; every worker is then stopped (killed only if it does not
stop) and joined, and the engine is closed. On the success path workers are never
killed: `close()` is a stop/stopped handshake that returns per-worker counters.

Publication reaches every worker: each chunk is checked whole here first (the
coordinator keeps the committed weights in the model it was given, as `LLM` does),
then sent to all workers; the version commits only when every worker acknowledged its
finish. Any worker's failure blocks generation until a newer full update succeeds.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ouro_cli.engine.contract import (
    EngineBusy,
    EngineError,
    Prompt,
    PublicationError,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    WeightChunk,
)
from ouro_cli.engine.frontend import Admission, GenerationControl, make_output, take_requests
from ouro_cli.engine.publication import WeightPublisher, physical_name
from ouro_cli.engine.setup import EngineLimits, open_model
from ouro_cli.settings import ExecutionSettings
from ouro_cli.testing import faults

from . import protocol as P
from .transport import resolve_transport_name
from .worker import WorkerSpec, worker_main


class WorkerFailed(EngineError):
    """A PD worker exited, raised or did not answer in time; the engine is closed."""


@dataclass
class _Worker:
    name: str
    role: str
    index: int
    device: str
    process: Any
    conn: Any
    info: P.Ready | None = None
    stats: P.WorkerStats | None = None  # the latest a message carried
    load: int = 0
    full: bool = False

    def describe(self) -> str:
        pid = self.process.pid if self.process is not None else "?"
        role = "prefill" if self.role == P.PREFILL_ROLE else "decode"
        return f"{role} worker {self.name} (pid {pid}, {self.device})"


@dataclass(order=True)
class _Request:
    index: int
    rid: str = field(compare=False)
    prompt: list[int] = field(compare=False)
    params: SamplingParams = field(compare=False)
    max_kv_tokens: int = field(compare=False)
    text: str | None = field(default=None, compare=False)
    d: _Worker | None = field(default=None, compare=False)
    p: _Worker | None = field(default=None, compare=False)
    state: str = field(default="pending", compare=False)
    output: list[int] = field(default_factory=list, compare=False)
    depths: list[int] = field(default_factory=list, compare=False)
    logprobs: list[float] = field(default_factory=list, compare=False)
    finish_reason: str | None = field(default=None, compare=False)

    def owed_by(self) -> _Worker | None:
        return self.p if self.state == "prefilling" else self.d


class PDEngine(GenerationControl):
    """Prefill/decode-disaggregated Ouro engine (implements contract.RolloutEngine).

    `prefill_devices` / `decode_devices` are device indices: CUDA devices when CUDA is
    used, otherwise each index is one CPU worker process. `transport` is "auto" (NIXL
    when installed, else shared memory), "nixl" or "shm". `timeout` bounds how long any
    worker may stay silent while it owes an answer. `worker_threads` is each worker's torch
    thread count (it matters for CPU workers). Other options are `LLM`'s and apply to every
    worker (`max_num_seqs` and `kv_blocks` per decode worker); the workers compute with the
    model's execution settings (`execution` replaces them, as in `LLM`).
    """

    def __init__(
        self,
        model: str | Path | nn.Module,
        *,
        prefill_devices: Seq[int],
        decode_devices: Seq[int],
        device: str | None = None,
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
        transport: str = "auto",
        timeout: float = 300.0,
        start_timeout: float = 300.0,
        worker_threads: int = 1,
        execution: ExecutionSettings | None = None,
    ) -> None:
        if not prefill_devices or not decode_devices:
            raise ValueError("PD needs at least one prefill and one decode device")
        if len(set(prefill_devices)) != len(prefill_devices) or len(set(decode_devices)) != len(decode_devices):
            raise ValueError("a device index appears twice in one role")
        # the coordinator's copy stays on the CPU: it checks publications and seeds the workers
        self.model, self.codec = open_model(model, dtype=dtype, tokenizer=tokenizer)
        if execution is not None:
            self.model.execution = execution
        self.worker_threads = worker_threads
        cfg = self.model.config
        self.limits = EngineLimits.resolve(
            cfg,
            max_num_seqs=max_num_seqs,
            kv_blocks=kv_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            max_prefill_tokens=max_prefill_tokens,
        )
        self.num_loops = cfg.total_ut_steps
        self.vocab_size = cfg.vocab_size
        self.transport = resolve_transport_name(transport)
        self.timeout, self.start_timeout = timeout, start_timeout
        use_cuda = torch.cuda.is_available() if device in (None, "auto") else str(device).startswith("cuda")
        self.publisher = WeightPublisher(self.model, weight_version)
        self._seeds = random.Random(seed)
        self._broken: str | None = None
        self.control = Admission(self.publisher, check=self._check_not_broken)
        self._next_request = 0
        self.final_counters: dict[str, dict[str, Any]] | None = None

        options = dict(attn_chunk=attn_chunk, cuda_graphs=cuda_graphs)
        self._start_workers(list(prefill_devices), list(decode_devices), use_cuda, options, weight_version)

    # ---- workers --------------------------------------------------------------------------

    def _start_workers(
        self, prefill: list[int], decode: list[int], use_cuda: bool, options: dict[str, Any], version: int
    ) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        weights = {
            n: p.detach().to("cpu" if not use_cuda else p.device).clone() for n, p in self.model.named_parameters()
        }
        roles = [(P.PREFILL_ROLE, i, d) for i, d in enumerate(prefill)] + [
            (P.DECODE_ROLE, i, d) for i, d in enumerate(decode)
        ]
        peer_pipes = {(pi, di): ctx.Pipe() for pi in range(len(prefill)) for di in range(len(decode))}
        self.workers: list[_Worker] = []
        try:
            for role, i, dev in roles:
                device = f"cuda:{dev}" if use_cuda else "cpu"
                spec = WorkerSpec(
                    role=role,
                    index=i,
                    device=device,
                    config=self.model.config,
                    weights=weights,
                    limits=self.limits,
                    core_options=options,
                    transport=self.transport,
                    weight_version=version,
                    execution=self.model.execution,
                    threads=self.worker_threads,
                )
                spec.fault = faults.pd_fault(spec.name)  # tests only (ouro_cli/testing/faults.py)
                if role == P.PREFILL_ROLE:
                    peers = {f"D{di}": peer_pipes[(i, di)][0] for di in range(len(decode))}
                else:
                    peers = {f"P{pi}": peer_pipes[(pi, i)][1] for pi in range(len(prefill))}
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main, args=(spec, child, peers), name=f"ouro-pd-{spec.name}", daemon=True
                )
                self.workers.append(_Worker(spec.name, role, i, device if use_cuda else f"cpu:{dev}", None, parent))
                proc.start()
                self.workers[-1].process = proc
                child.close()
            for a, b in peer_pipes.values():  # only the workers hold the P–D pipes
                a.close()
                b.close()
            waiting = {w.name for w in self.workers}
            deadline = time.monotonic() + self.start_timeout
            while waiting:
                w, msg = self._next(deadline - time.monotonic(), "start-up (ready)", waiting)
                if not isinstance(msg, P.Ready):
                    raise self._failure(f"{w.describe()} sent {type(msg).__name__} during start-up")
                w.info = msg
                waiting.discard(w.name)
        except BaseException:
            if self._broken is None:
                self._broken = "start-up failed"
                self._teardown()
            raise
        self.prefillers = [w for w in self.workers if w.role == P.PREFILL_ROLE]
        self.decoders = [w for w in self.workers if w.role == P.DECODE_ROLE]

    def _next(
        self, timeout: float, waiting_for: str, owing: set[str] | None = None, poll: float | None = None
    ) -> tuple[_Worker, object] | None:
        """The next message from any worker. WorkerFailed when one exits or reports an error, or
        when nothing arrives within `timeout`; with `poll`, None after `poll` seconds of silence."""
        if timeout <= 0:
            raise self._timeout(waiting_for, owing)
        by_conn = {w.conn: w for w in self.workers}
        by_sentinel = {w.process.sentinel: w for w in self.workers}
        ready = wait([*by_conn, *by_sentinel], timeout=timeout if poll is None else min(poll, timeout))
        if not ready:
            if poll is not None and poll < timeout:
                return None
            raise self._timeout(waiting_for, owing)
        for r in ready:  # messages first: a worker that reported an error and exited is explained by it
            if r in by_conn:
                w = by_conn[r]
                try:
                    msg = r.recv()
                except (EOFError, OSError):
                    continue
                if isinstance(msg, P.Error):
                    raise self._failure(f"{w.describe()} failed during {msg.where}: {msg.message}\n{msg.traceback}")
                return w, msg
        w = by_sentinel[next(r for r in ready if r in by_sentinel)]
        w.process.join(1.0)
        raise self._failure(
            f"{w.describe()} exited with code {w.process.exitcode} while the coordinator was waiting for {waiting_for}"
        )

    def _timeout(self, waiting_for: str, owing: set[str] | None) -> WorkerFailed:
        names = ", ".join(w.describe() for w in self.workers if owing is None or w.name in owing) or "no worker"
        return self._failure(f"no answer within {self.timeout:g} s while waiting for {waiting_for} (owed by {names})")

    def _failure(self, reason: str) -> WorkerFailed:
        """Mark the engine broken, stop and join every worker, and return the error to raise."""
        self._broken = reason
        self._teardown()
        return WorkerFailed(f"PD engine failed: {reason}")

    def _teardown(self, grace: float = 5.0) -> None:
        for w in self.workers:
            if w.process is not None and w.process.is_alive():
                try:
                    w.conn.send(P.Stop())
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + min(grace, self.timeout)
        for w in self.workers:
            if w.process is None:
                continue
            while w.process.is_alive() and time.monotonic() < deadline:
                try:  # keep its pipe drained so a blocked send cannot keep it alive
                    while w.conn.poll(0):
                        w.conn.recv()
                except (EOFError, OSError):
                    pass
                w.process.join(0.05)
            if w.process.is_alive():
                w.process.kill()
            w.process.join(10.0)
        for w in self.workers:
            w.conn.close()
        self.control.closed = True

    def _send(self, w: _Worker, msg: object) -> None:
        try:
            w.conn.send(msg)
        except (OSError, ValueError) as err:
            w.process.join(1.0)
            raise self._failure(f"{w.describe()} cannot be reached ({err}; exit code {w.process.exitcode})") from err

    # ---- generation -----------------------------------------------------------------------

    def generate(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        with self.control.admitted():
            reqs = self._make_requests(prompts, params)
            version = self.publisher.committed_version
            self._run(reqs)
            return [self._output(r, version) for r in reqs]

    def _run(self, reqs: list[_Request]) -> None:
        pending = list(reqs)
        heapq.heapify(pending)
        live: dict[str, _Request] = {}
        for w in self.workers:
            w.load, w.full = 0, False
        held = False
        last = time.monotonic()
        while pending or live:
            paused, abort = self.control.requested()
            if abort:
                self._cancel(reqs, live)
                return
            if paused != held:
                for d in self.decoders:
                    self._send(d, P.Pause() if paused else P.Resume())
                held = paused
            if not paused:
                self._dispatch(pending, live)
            owing = {r.owed_by().name for r in live.values() if r.owed_by() is not None}
            silent = time.monotonic() - last
            # a paused engine owes nothing; otherwise someone owes an answer within `timeout`
            got = self._next(self.timeout if held else self.timeout - silent, "request progress", owing, poll=0.05)
            if got is None:
                continue
            last = time.monotonic()
            self._handle(*got, pending, live)

    def _dispatch(self, pending: list[_Request], live: dict[str, _Request]) -> None:
        while pending:
            free = [d for d in self.decoders if d.load < self.limits.max_num_seqs and not d.full]
            if not free:
                return
            d = min(free, key=lambda x: (x.load, x.index))
            r = heapq.heappop(pending)
            r.d, r.state = d, "reserving"
            d.load += 1
            live[r.rid] = r
            self._send(d, P.Reserve(r.rid, len(r.prompt), r.max_kv_tokens))

    def _handle(self, w: _Worker, msg: object, pending: list[_Request], live: dict[str, _Request]) -> None:
        match msg:
            case P.Reserved():
                r = live[msg.rid]
                p = min(self.prefillers, key=lambda x: (x.load, x.index))
                r.p, r.state = p, "prefilling"
                p.load += 1
                self._send(p, P.Prefill(msg.rid, r.prompt, r.d.name, msg.dst_slots, msg.row))
            case P.ReserveFailed():
                r = live.pop(msg.rid)
                w.load -= 1
                if w.load == 0:
                    raise self._failure(f"{w.describe()} cannot reserve KV for request {r.rid} on an empty cache (bug)")
                w.full = True
                r.d, r.state = None, "pending"
                heapq.heappush(pending, r)
            case P.Committed():
                w.stats = msg.stats
                r = live[msg.rid]
                r.state = "activating"
                self._send(r.d, P.Activate(msg.rid, r.index, r.prompt, r.params, r.max_kv_tokens))
            case P.Activated():
                r = live[msg.rid]
                r.state = "decoding"
                self._send(r.p, P.Release(r.rid))
                r.p.load -= 1
            case P.Tokens():
                w.stats = msg.stats
                self._take_tokens(msg, live)
            case _:
                raise self._failure(f"{w.describe()} sent an unexpected {type(msg).__name__}")

    def _take_tokens(self, msg: P.Tokens, live: dict[str, _Request]) -> None:
        for new in msg.new:
            r = live[new.rid]
            r.output += new.ids
            r.depths += new.depths
            r.logprobs += new.logprobs
        for done in msg.finished:
            r = live.pop(done.rid)
            r.finish_reason, r.state = done.reason, "done"
            r.d.load -= 1
            r.d.full = False

    def _cancel(self, reqs: list[_Request], live: dict[str, _Request]) -> None:
        """Abort: P first (so no late WRITE lands in blocks D gives back), then D."""
        for group in (self.prefillers, self.decoders):
            for w in group:
                self._send(w, P.Cancel())
            waiting = {w.name for w in group}
            deadline = time.monotonic() + self.timeout
            while waiting:
                w, msg = self._next(deadline - time.monotonic(), "cancellation", waiting)
                if isinstance(msg, P.Cancelled):
                    w.stats = msg.stats
                    waiting.discard(w.name)
                elif isinstance(msg, P.Tokens):
                    w.stats = msg.stats
                    self._take_tokens(msg, live)
                elif not isinstance(msg, P.Committed | P.Activated | P.Reserved | P.ReserveFailed):
                    raise self._failure(f"{w.describe()} sent {type(msg).__name__} during cancellation")
        for r in reqs:
            if r.finish_reason is None:
                r.finish_reason = "abort"

    def _make_requests(self, prompts: Seq[Prompt], params) -> list[_Request]:
        lim = self.limits
        intake = take_requests(
            prompts,
            params,
            codec=self.codec,
            vocab_size=self.vocab_size,
            num_loops=self.num_loops,
            seeds=self._seeds,
            first_id=self._next_request,
            max_model_len=lim.max_model_len,
            block_size=lim.block_size,
            kv_blocks=lim.kv_blocks,
            cache_name="a decode worker's cache",
            adjust=_no_speculation,
        )
        self._next_request += len(intake)
        return [
            _Request(
                index=r.index, rid=r.request_id, prompt=r.ids, params=r.params, max_kv_tokens=r.kv_tokens, text=r.text
            )
            for r in intake
        ]

    def _output(self, r: _Request, version: int) -> RequestOutput:
        return make_output(
            request_id=r.rid,
            prompt=r.prompt,
            output=r.output,
            depths=r.depths,
            logprobs=r.logprobs,
            finish_reason=r.finish_reason,
            params=r.params,
            version=version,
            codec=self.codec,
            text_prompt=r.text,
        )

    # ---- weight publication ---------------------------------------------------------------

    def start_weight_update(self, version: int) -> None:
        with self.control.lock:
            self.control.check_idle_for_update()
            self.publisher.start(version)  # version > every version ever attempted, checked here once
            self._broadcast(P.StartUpdate(version), f"start of the update to version {version}")

    def update_weights(self, chunk: WeightChunk) -> None:
        with self.control.lock:
            self.control.check_open()
            items = [(physical_name(name), tensor) for name, tensor in chunk]
            self.publisher.update(items)  # the whole chunk checked before any worker sees it
            staged = [(name, t.detach()) for name, t in items]
            self._broadcast(P.Update(staged), f"a chunk of the update to version {self.publisher.pending}")

    def finish_weight_update(self) -> None:
        with self.control.lock:
            self.control.check_open()
            pub = self.publisher
            if pub.in_progress and not set(pub.params) - pub.received:
                self._broadcast(P.FinishUpdate(), f"the commit of version {pub.pending}")
            pub.finish()

    def _broadcast(self, msg: object, what: str) -> None:
        """Send to every worker and wait for every answer; any refusal fails the update (generation
        stays blocked until a newer full update), a dead or silent worker fails the engine."""
        for w in self.workers:
            self._send(w, msg)
        waiting = {w.name for w in self.workers}
        failed: list[str] = []
        deadline = time.monotonic() + self.timeout
        while waiting:
            w, answer = self._next(deadline - time.monotonic(), what, waiting)
            if isinstance(answer, P.Failed):
                failed.append(f"{w.describe()}: {answer.reason}")
            elif not isinstance(answer, P.Ok):
                raise self._failure(f"{w.describe()} answered {type(answer).__name__} to {what}")
            waiting.discard(w.name)
        if failed:
            reason = f"{what} failed on {'; '.join(failed)}"
            if self.publisher.in_progress:
                self.publisher.fail(reason)
            raise PublicationError(reason)

    def get_weight_version(self) -> int:
        return self.publisher.committed_version

    # ---- metrics and shutdown -------------------------------------------------------------

    def devices(self) -> set[str]:
        """Distinct devices the workers run on ("cpu" once for CPU workers), for device-hours."""
        return {"cpu" if w.device.startswith("cpu") else w.device for w in self.workers}

    def work_counters(self) -> Mapping[str, int]:
        total: dict[str, int] = {}
        for w in self.workers:
            for key, value in (w.stats.work if w.stats else {}).items():
                total[key] = total.get(key, 0) + value
        prefill = [w.stats.worker for w in getattr(self, "prefillers", []) if w.stats]
        total["kv_transfers"] = sum(s.transfers for s in prefill)
        total["kv_transfer_bytes"] = sum(s.bytes for s in prefill)
        return total

    def worker_counters(self) -> dict[str, dict[str, Any]]:
        """Latest per-worker counters (tokens, bytes, transfers, seconds, blocks in use, weight version)."""
        if self.final_counters is not None:
            return self.final_counters
        return {w.name: dataclasses.asdict(w.stats.worker) if w.stats else {} for w in self.workers}

    def stop(self) -> dict[str, dict[str, Any]]:
        """The stop/stopped handshake: every worker reports its counters and leaves its loop; all joined."""
        control = self.control
        with control.lock:
            if control.generating:
                raise EngineBusy("close() while generate is running; pause with abort=True first")
            if control.closed:
                return self.final_counters or {}
            for w in self.workers:
                self._send(w, P.Stop())
            counters: dict[str, dict[str, Any]] = {}
            waiting = {w.name for w in self.workers}
            deadline = time.monotonic() + self.timeout
            while waiting:
                w, msg = self._next(deadline - time.monotonic(), "stopped", waiting)
                if isinstance(msg, P.Stopped):
                    counters[w.name] = {**dataclasses.asdict(msg.stats.worker), "role": w.role, "device": w.device}
                    w.stats = msg.stats
                    waiting.discard(w.name)
            stuck = []
            for w in self.workers:
                w.process.join(self.timeout)
                if w.process.is_alive():  # it answered `stopped` but does not exit: a failure, never hidden
                    stuck.append(w.describe())
                    w.process.kill()
                    w.process.join()
                w.conn.close()
            control.closed = True
            self.final_counters = counters
            if stuck:
                raise WorkerFailed(f"answered stop but did not exit within {self.timeout:g} s: {', '.join(stuck)}")
            return counters

    def close(self) -> None:
        if not self.control.closed:
            self.stop()

    def _check_not_broken(self) -> None:
        if self._broken is not None:
            raise WorkerFailed(f"PD engine failed earlier: {self._broken}")

    def __enter__(self) -> PDEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _no_speculation(params: SamplingParams, index: int) -> SamplingParams:
    if params.speculative_tokens:
        raise RequestRejected(f"request {index}: the PD engine does not run self-speculation")
    return params
