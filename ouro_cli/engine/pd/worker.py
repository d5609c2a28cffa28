"""A PD worker process: one device, one role (prefill P or decode D), driven over pipes.

Each worker builds its own copy of the model from the weights it was spawned with
and the `EngineCore` the local `LLM` builds around it (its paged per-loop KV cache,
model runner, sampler, work counters and weight publisher), so a worker computes
exactly what the local engine computes; only who runs which part of a request differs:

- P runs `ModelRunner.prefill` at full depth into its own blocks, WRITEs the K/V
  planes of every prompt position and the last position's logits into the decode
  worker's reserved slots and landing row (transport/), and notifies.
- D reserves blocks, activates a request once the notification arrived
  (`Scheduler.activate`), samples token 0 from the landed logits with the request's own
  seeded stream (`EngineCore.sample`), then runs the local engine's continuous batching
  (`EngineCore.step`: decode steps, preemption with a local recompute) and streams new
  tokens after every step.

The worker is single-threaded: it answers control messages between steps, so a
message never observes a half-done step. It never dies on purpose: it leaves its
loop on `stop` (answering `stopped` with its counters), on an exception (answering
`error`), or when the coordinator's pipe closes. `fault` injects failures for tests.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from ouro_cli.engine.setup import EngineLimits
from ouro_cli.settings import ExecutionSettings

from . import protocol as P


@dataclass
class WorkerSpec:
    role: str
    index: int
    device: str
    config: Any
    weights: dict[str, torch.Tensor]
    limits: EngineLimits
    core_options: dict[str, Any]  # EngineCore's keyword arguments (attn_chunk, cuda_graphs)
    transport: str
    weight_version: int = 0
    fault: dict[str, Any] = field(default_factory=dict)
    execution: ExecutionSettings = field(default_factory=ExecutionSettings)  # the coordinator model's
    threads: int = 1  # torch threads of this process

    @property
    def name(self) -> str:
        return f"{'P' if self.role == P.PREFILL_ROLE else 'D'}{self.index}"


def worker_main(spec: WorkerSpec, conn: Connection, peers: dict[str, Connection]) -> None:
    os.dup2(2, 1)  # workers never print results; NIXL/UCX log to stdout, which `--json` keeps for one document
    torch.set_num_threads(spec.threads)
    try:
        worker = (PrefillWorker if spec.role == P.PREFILL_ROLE else DecodeWorker)(spec, conn, peers)
    except BaseException as err:  # noqa: BLE001 — report, then exit
        _send_error(conn, "start-up", err)
        return
    try:
        worker.loop()
    except BaseException as err:  # noqa: BLE001
        _send_error(conn, "running", err)
    finally:
        worker.transport.close()


def _send_error(conn: Connection, where: str, err: BaseException) -> None:
    try:
        conn.send(P.Error(where, f"{type(err).__name__}: {err}", traceback.format_exc(limit=8)))
    except (OSError, ValueError):
        pass


class _Worker:
    def __init__(self, spec: WorkerSpec, conn: Connection, peers: dict[str, Connection]) -> None:
        from ouro_cli.engine.core import EngineCore
        from ouro_cli.model import from_state_dict

        from .transport import make_transport

        self.spec, self.conn, self.peers = spec, conn, peers
        self.name = spec.name
        if str(spec.device).startswith("cuda"):
            torch.cuda.set_device(spec.device)  # this process drives one GPU: streams, graphs, NIXL default to it
        weights = {n: t.to(spec.device, copy=True) for n, t in spec.weights.items()}  # own memory, not the spawner's
        spec.weights = {}
        model = from_state_dict(spec.config, weights, device=spec.device)
        model.execution = spec.execution  # before the core: it decides, e.g., whether to fuse projections
        self.core = EngineCore(model, spec.limits, weight_version=spec.weight_version, **spec.core_options)
        self.counters = P.WorkerCounters(weight_version=spec.weight_version)
        self.transport = make_transport(spec.transport, f"{self.name}-{os.getpid()}")
        self.running = True

    # ---- the loop ----------------------------------------------------------------------

    def loop(self) -> None:
        self.handshake()
        self.conn.send(
            P.Ready(
                name=self.name,
                pid=os.getpid(),
                device=str(self.core.device),
                kv_blocks=self.core.kv.num_blocks,
                block_size=self.core.limits.block_size,
                transport=self.transport.name,
            )
        )
        while self.running:
            busy = self.has_work()
            ready = wait([self.conn, *self.peers.values()], timeout=0 if busy else None)
            for c in ready:
                if not c.poll():  # an earlier message's handler may have consumed this one
                    continue
                try:
                    msg = c.recv()
                except EOFError:
                    if c is self.conn:  # the coordinator is gone: nothing left to serve
                        self.running = False
                        return
                    continue
                if c is self.conn:
                    self.handle(msg)
                else:
                    self.handle_peer(msg)
                if not self.running:
                    return
            if self.has_work():  # re-checked: a message (cancel, pause) may have changed it
                self.step()

    def handshake(self) -> None: ...

    def has_work(self) -> bool:
        return False

    def step(self) -> None: ...

    def handle_peer(self, msg: object) -> None: ...

    def handle(self, msg: object) -> None:
        if isinstance(msg, P.StartUpdate | P.Update | P.FinishUpdate):
            self.publish(msg)
        elif isinstance(msg, P.Stop):
            self.running = False
            self.conn.send(P.Stopped(self.stats()))
        else:
            self.handle_role(msg)

    def handle_role(self, msg: object) -> None:
        raise RuntimeError(f"{self.name}: unexpected message {type(msg).__name__}")

    def publish(self, msg: P.StartUpdate | P.Update | P.FinishUpdate) -> None:
        core, publisher = self.core, self.core.publisher
        try:
            match msg:
                case P.StartUpdate(version=version):
                    if publisher.in_progress:  # the coordinator abandoned the previous attempt
                        publisher.fail("abandoned by the coordinator")
                    core.start_weight_update(version)
                    self.drop_all()
                case P.Update(items=items):
                    fail = self.spec.fault.get("fail_update_version")
                    if fail is not None and publisher.pending == fail:
                        publisher.fail("injected fault")
                        raise RuntimeError(f"injected fault: {self.name} fails the update to version {fail}")
                    core.update_weights(items)
                case P.FinishUpdate():
                    core.finish_weight_update()
                    self.counters.weight_version = publisher.committed_version
        except Exception as err:  # noqa: BLE001 — a refused update is an answer, not a crash
            self.conn.send(P.Failed(f"{type(err).__name__}: {err}"))
            return
        self.conn.send(P.Ok(publisher.committed_version))

    def drop_all(self) -> None:
        """Weights changed: forget every request (the engine is idle, so there is none)."""

    def stats(self) -> P.WorkerStats:
        self.counters.blocks_in_use = self.core.kv.num_blocks - self.core.kv.allocator.num_free
        return P.WorkerStats(dataclasses.replace(self.counters), self.core.work_counters())


class PrefillWorker(_Worker):
    def __init__(self, spec: WorkerSpec, conn: Connection, peers: dict[str, Connection]) -> None:
        super().__init__(spec, conn, peers)
        self.queue: deque[P.Prefill] = deque()
        self.staged: dict[str, list[int]] = {}  # rid -> own blocks held until D acknowledged

    def handshake(self) -> None:
        for peer, c in self.peers.items():  # every decode worker sends its registration first
            msg = c.recv()
            assert isinstance(msg, P.Register) and msg.decoder == peer, (msg, peer)
            self.transport.connect(peer, msg.registration)

    def has_work(self) -> bool:
        return bool(self.queue) and self._blocks_for(self.queue[0].tokens) <= self.core.kv.allocator.num_free

    def _blocks_for(self, tokens: list[int]) -> int:
        from ouro_cli.engine.kv_cache import blocks_needed

        return blocks_needed(len(tokens), self.core.limits.block_size)

    def handle_role(self, msg: object) -> None:
        match msg:
            case P.Prefill():
                self.queue.append(msg)
            case P.Release(rid=rid):
                self.core.kv.allocator.free(self.staged.pop(rid))
            case P.Cancel():
                dropped = [m.rid for m in self.queue]
                self.queue.clear()
                for blocks in self.staged.values():  # writes are synchronous: nothing in flight reads them
                    self.core.kv.allocator.free(blocks)
                self.staged.clear()
                self.conn.send(P.Cancelled(dropped, self.stats()))
            case _:
                super().handle_role(msg)

    def step(self) -> None:
        from ouro_cli.engine.runner import PrefillItem

        msg = self.queue.popleft()
        rid, tokens, peer = msg.rid, msg.tokens, msg.decoder
        core = self.core
        core.publisher.check_usable()
        if self.spec.fault.get("hang_on_prefill"):
            time.sleep(3600)
        t0 = time.perf_counter()
        blocks = core.kv.allocator.allocate(self._blocks_for(tokens))
        self.staged[rid] = blocks
        src_slots = core.kv.slots(blocks, 0, len(tokens))
        logits = core.runner.prefill(PrefillItem(tokens, [core.num_loops] * len(tokens), src_slots))
        t1 = time.perf_counter()
        nbytes = self.transport.write(peer, core.kv.k, core.kv.v, src_slots, msg.dst_slots, logits, msg.row, rid)
        if not self.transport.notifies_itself:
            self.peers[peer].send(P.Notify(rid))
        t2 = time.perf_counter()
        c = self.counters
        c.tokens += len(tokens)
        c.bytes += nbytes
        c.transfers += 1
        c.seconds += t2 - t0
        self.conn.send(P.Committed(rid, nbytes, t2 - t1, self.stats()))

    def drop_all(self) -> None:
        self.queue.clear()
        self.staged.clear()  # start_weight_update reset the allocator


class DecodeWorker(_Worker):
    def __init__(self, spec: WorkerSpec, conn: Connection, peers: dict[str, Connection]) -> None:
        super().__init__(spec, conn, peers)
        core = self.core
        rows = core.limits.max_num_seqs
        self.landing = torch.zeros(rows, core.model.config.vocab_size, dtype=core.dtype, device=core.device)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.reserved: dict[str, tuple[list[int], int, int]] = {}  # rid -> (blocks, row, n_prompt)
        self.notified: set[str] = set()
        self.sched = core.scheduler()
        self.reported: dict[str, int] = {}
        self.paused = False

    def handshake(self) -> None:
        registration = self.transport.register(self.core.kv.k, self.core.kv.v, self.landing)
        for c in self.peers.values():
            c.send(P.Register(self.name, registration))

    def has_work(self) -> bool:
        return self.sched.has_work() and not self.paused

    def handle_peer(self, msg: object) -> None:
        if isinstance(msg, P.Notify):
            self.notified.add(msg.rid)

    def handle_role(self, msg: object) -> None:
        match msg:
            case P.Reserve():
                self.reserve(msg)
            case P.Activate():
                self.activate(msg)
            case P.Cancel():
                self.cancel()
            case P.Pause():
                self.paused = True
            case P.Resume():
                self.paused = False
            case _:
                super().handle_role(msg)

    def reserve(self, msg: P.Reserve) -> None:
        from ouro_cli.engine.kv_cache import blocks_needed

        kv = self.core.kv
        need = blocks_needed(min(msg.n_prompt + 1, msg.max_kv_tokens), self.core.limits.block_size)  # as admitted
        if need > kv.allocator.num_free or not self.free_rows:
            self.conn.send(P.ReserveFailed(msg.rid, kv.allocator.num_free))
            return
        blocks = kv.allocator.allocate(need)
        row = self.free_rows.pop()
        self.reserved[msg.rid] = (blocks, row, msg.n_prompt)
        self.conn.send(P.Reserved(msg.rid, kv.slots(blocks, 0, msg.n_prompt), row))

    def activate(self, msg: P.Activate) -> None:
        from ouro_cli.engine.request_rng import RequestRng
        from ouro_cli.engine.scheduler import Sequence

        rid = msg.rid
        deadline = time.monotonic() + 30.0
        while rid not in self.notified:  # the bytes must have arrived, not merely been sent
            self.notified.update(self.transport.delivered())
            if rid in self.notified:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"request {rid}: activated but the KV write was never notified")
            for c in wait(list(self.peers.values()), timeout=0.01):
                self.handle_peer(c.recv())
        self.notified.discard(rid)
        blocks, row, n_prompt = self.reserved.pop(rid)
        core = self.core
        seq = Sequence(
            index=msg.index,
            request_id=rid,
            prompt=list(msg.prompt),
            params=msg.params,
            rng=RequestRng(msg.params.seed),
            max_kv_tokens=msg.max_kv_tokens,
            blocks=blocks,
            num_cached=n_prompt,
        )
        self.sched.activate(seq)
        self.conn.send(P.Activated(rid))
        t0 = time.perf_counter()
        core.sample([seq], self.landing[row : row + 1].clone(), [core.num_loops], self.sched)
        self.free_rows.append(row)
        c = self.counters
        c.transfers += 1
        c.bytes += n_prompt * core.kv.bytes_per_token() + self.landing[row].numel() * self.landing.element_size()
        c.seconds += time.perf_counter() - t0
        self.report([seq])

    def step(self) -> None:
        t0 = time.perf_counter()
        plan = self.core.step(self.sched)  # only sequences preempted here come back through prefill: recomputed
        self.counters.seconds += time.perf_counter() - t0
        self.report(plan.decode + plan.prefill)

    def report(self, seqs: list) -> None:
        new, finished = [], []
        for seq in seqs:
            done = self.reported.get(seq.request_id, 0)
            if len(seq.output) > done:
                new.append(P.NewTokens(seq.request_id, seq.output[done:], seq.depths[done:], seq.logprobs[done:]))
                self.counters.tokens += len(seq.output) - done
                self.reported[seq.request_id] = len(seq.output)
            if seq.finish_reason is not None:
                finished.append(P.Finished(seq.request_id, seq.finish_reason))
                self.reported.pop(seq.request_id, None)
        if new or finished:
            self.conn.send(P.Tokens(new, finished, self.stats()))

    def cancel(self) -> None:
        aborted = []
        for seq in self.sched.drain():
            seq.finish_reason = "abort"
            aborted.append(seq)
        self.report(aborted)
        for blocks, row, _ in self.reserved.values():
            self.core.kv.allocator.free(blocks)
            self.free_rows.append(row)
        dropped = list(self.reserved)
        self.reserved.clear()
        self.notified.clear()
        self.conn.send(P.Cancelled(dropped, self.stats()))

    def drop_all(self) -> None:
        self.sched.drain()
        self.reserved.clear()
        self.notified.clear()
        self.free_rows = list(range(self.core.limits.max_num_seqs - 1, -1, -1))
