"""A PD worker process: one device, one role (prefill P or decode D), driven over pipes.

Each worker builds its own copy of the model from the weights it was spawned with
and an `LLM` around it (its paged per-loop KV cache, model runner, sampler, work
counters and weight publisher), so a worker computes exactly what the local engine
computes; only who runs which part of a request differs:

- P runs `ModelRunner.prefill` at full depth into its own blocks, WRITEs the K/V
  planes of every prompt position and the last position's logits into the decode
  worker's reserved slots and landing row (transport/), and notifies.
- D reserves blocks, activates a request once the notification arrived, samples
  token 0 from the landed logits with the request's own seeded stream, then runs
  the local engine's continuous batching (Scheduler, decode steps, preemption with a
  local recompute) and streams new tokens after every step.

The worker is single-threaded: it answers control messages between steps, so a
message never observes a half-done step. It never dies on purpose: it leaves its
loop on `stop` (answering `stopped` with its counters), on an exception (answering
`error`), or when the coordinator's pipe closes. `fault` injects failures for tests.
"""

from __future__ import annotations

import os
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from ouro_cli.settings import ExecutionSettings

from . import protocol as P


@dataclass
class WorkerSpec:
    role: str
    index: int
    device: str
    config: Any
    weights: dict[str, torch.Tensor]
    engine_options: dict[str, Any]
    transport: str
    weight_version: int = 0
    fault: dict[str, Any] = field(default_factory=dict)
    execution: ExecutionSettings = field(default_factory=ExecutionSettings)  # the coordinator model's
    threads: int = 1  # torch threads of this process

    @property
    def name(self) -> str:
        return f"{'P' if self.role == P.PREFILL_ROLE else 'D'}{self.index}"


@dataclass
class Counters:
    """What `stop` reports per worker (and every message piggybacks for metrics)."""

    tokens: int = 0          # P: prompt tokens prefilled; D: tokens sampled
    bytes: int = 0           # KV + logits bytes written (P) or received (D)
    transfers: int = 0
    seconds: float = 0.0     # busy time: model execution and transfers
    blocks_in_use: int = 0
    weight_version: int = 0


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
        conn.send((P.ERROR, where, f"{type(err).__name__}: {err}", traceback.format_exc(limit=8)))
    except (OSError, ValueError):
        pass


class _Worker:
    def __init__(self, spec: WorkerSpec, conn: Connection, peers: dict[str, Connection]) -> None:
        from ouro_cli.engine.engine import LLM
        from ouro_cli.model import from_state_dict

        from .transport import make_transport

        self.spec, self.conn, self.peers = spec, conn, peers
        self.name = spec.name
        if str(spec.device).startswith("cuda"):
            torch.cuda.set_device(spec.device)  # this process drives one GPU: streams, graphs, NIXL default to it
        weights = {n: t.to(spec.device, copy=True) for n, t in spec.weights.items()}  # own memory, not the spawner's
        spec.weights = {}
        model = from_state_dict(spec.config, weights, device=spec.device)
        self.llm = LLM(model, weight_version=spec.weight_version, execution=spec.execution, **spec.engine_options)
        self.counters = Counters(weight_version=spec.weight_version)
        self.transport = make_transport(spec.transport, f"{self.name}-{os.getpid()}")
        self.running = True

    # ---- the loop ----------------------------------------------------------------------

    def loop(self) -> None:
        self.handshake()
        self.conn.send((P.READY, {"name": self.name, "pid": os.getpid(), "device": str(self.llm.device),
                                  "kv_blocks": self.llm.kv.num_blocks, "block_size": self.llm.block_size,
                                  "transport": self.transport.name}))
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

    def handle_peer(self, msg: tuple) -> None: ...

    def handle(self, msg: tuple) -> None:
        tag = msg[0]
        if tag in (P.START_UPDATE, P.UPDATE, P.FINISH_UPDATE):
            self.publish(tag, *msg[1:])
        elif tag == P.STOP:
            self.running = False
            self.counters.blocks_in_use = self.llm.kv.num_blocks - self.llm.kv.allocator.num_free
            self.conn.send((P.STOPPED, self.counters.__dict__.copy(), self.llm.work_counters()))
        else:
            self.handle_role(msg)

    def handle_role(self, msg: tuple) -> None:
        raise RuntimeError(f"{self.name}: unexpected message {msg[0]!r}")

    def publish(self, tag: str, *args: Any) -> None:
        llm = self.llm
        try:
            if tag == P.START_UPDATE:
                if llm.publisher.in_progress:  # the coordinator abandoned the previous attempt
                    llm.publisher._fail("abandoned by the coordinator")
                llm.start_weight_update(args[0])
                self.drop_all()
            elif tag == P.UPDATE:
                fail = self.spec.fault.get("fail_update_version")
                if fail is not None and llm.publisher.pending == fail:
                    llm.publisher._fail("injected fault")
                    raise RuntimeError(f"injected fault: {self.name} fails the update to version {fail}")
                llm.update_weights(args[0])
            else:
                llm.finish_weight_update()
                self.counters.weight_version = llm.get_weight_version()
        except Exception as err:  # noqa: BLE001 — a refused update is an answer, not a crash
            self.conn.send((P.FAILED, f"{type(err).__name__}: {err}"))
            return
        self.conn.send((P.OK, llm.get_weight_version()))

    def drop_all(self) -> None:
        """Weights changed: forget every request (the engine is idle, so there is none)."""

    def stats(self) -> dict[str, Any]:
        self.counters.blocks_in_use = self.llm.kv.num_blocks - self.llm.kv.allocator.num_free
        return {"worker": self.counters.__dict__.copy(), "work": self.llm.work_counters()}


class PrefillWorker(_Worker):
    def __init__(self, spec: WorkerSpec, conn: Connection, peers: dict[str, Connection]) -> None:
        super().__init__(spec, conn, peers)
        self.queue: deque[tuple] = deque()
        self.staged: dict[str, list[int]] = {}  # rid -> own blocks held until D acknowledged

    def handshake(self) -> None:
        for peer, c in self.peers.items():  # every decode worker sends its registration first
            tag, name, registration = c.recv()
            assert tag == P.REGISTER and name == peer, (tag, name, peer)
            self.transport.connect(peer, registration)

    def has_work(self) -> bool:
        return bool(self.queue) and self._blocks_for(self.queue[0]) <= self.llm.kv.allocator.num_free

    def _blocks_for(self, msg: tuple) -> int:
        from ouro_cli.engine.kv_cache import blocks_needed

        return blocks_needed(len(msg[2]), self.llm.block_size)

    def handle_role(self, msg: tuple) -> None:
        tag = msg[0]
        if tag == P.PREFILL:
            self.queue.append(msg)
        elif tag == P.RELEASE:
            self.llm.kv.allocator.free(self.staged.pop(msg[1]))
        elif tag == P.CANCEL:
            dropped = [m[1] for m in self.queue]
            self.queue.clear()
            for blocks in self.staged.values():  # writes are synchronous: nothing in flight reads them
                self.llm.kv.allocator.free(blocks)
            self.staged.clear()
            self.conn.send((P.CANCELLED, dropped, self.stats()))
        else:
            super().handle_role(msg)

    def step(self) -> None:
        from ouro_cli.engine.runner import PrefillItem

        _, rid, tokens, peer, dst_slots, row = self.queue.popleft()
        llm = self.llm
        llm.publisher.check_usable()
        if self.spec.fault.get("hang_on_prefill"):
            time.sleep(3600)
        t0 = time.perf_counter()
        blocks = llm.kv.allocator.allocate(self._blocks_for((None, None, tokens)))
        self.staged[rid] = blocks
        src_slots = llm.kv.slots(blocks, 0, len(tokens))
        logits = llm.runner.prefill(PrefillItem(tokens, [llm.num_loops] * len(tokens), src_slots))
        t1 = time.perf_counter()
        nbytes = self.transport.write(peer, llm.kv.k, llm.kv.v, src_slots, dst_slots, logits, row, rid)
        if not self.transport.notifies_itself:
            self.peers[peer].send((P.NOTIFY, rid))
        t2 = time.perf_counter()
        c = self.counters
        c.tokens += len(tokens)
        c.bytes += nbytes
        c.transfers += 1
        c.seconds += t2 - t0
        self.conn.send((P.COMMITTED, rid, nbytes, t2 - t1, self.stats()))

    def drop_all(self) -> None:
        self.queue.clear()
        self.staged.clear()  # start_weight_update reset the allocator


class DecodeWorker(_Worker):
    def __init__(self, spec: WorkerSpec, conn: Connection, peers: dict[str, Connection]) -> None:
        from ouro_cli.engine.scheduler import Scheduler

        super().__init__(spec, conn, peers)
        llm = self.llm
        self.landing = torch.zeros(llm.max_num_seqs, llm.model.config.vocab_size, dtype=llm.dtype, device=llm.device)
        self.free_rows = list(range(llm.max_num_seqs - 1, -1, -1))
        self.reserved: dict[str, tuple[list[int], int, int]] = {}  # rid -> (blocks, row, n_prompt)
        self.notified: set[str] = set()
        self.sched = Scheduler(llm.kv.allocator, llm.block_size, llm.max_num_seqs, llm.max_prefill_tokens)
        self.reported: dict[str, int] = {}
        self.paused = False

    def handshake(self) -> None:
        registration = self.transport.register(self.llm.kv.k, self.llm.kv.v, self.landing)
        for c in self.peers.values():
            c.send((P.REGISTER, self.name, registration))

    def has_work(self) -> bool:
        return self.sched.has_work() and not self.paused

    def handle_peer(self, msg: tuple) -> None:
        if msg[0] == P.NOTIFY:
            self.notified.add(msg[1])

    def handle_role(self, msg: tuple) -> None:
        tag = msg[0]
        if tag == P.RESERVE:
            self.reserve(*msg[1:])
        elif tag == P.ACTIVATE:
            self.activate(*msg[1:])
        elif tag == P.CANCEL:
            self.cancel()
        elif tag == P.PAUSE:
            self.paused = True
        elif tag == P.RESUME:
            self.paused = False
        else:
            super().handle_role(msg)

    def reserve(self, rid: str, n_prompt: int, max_kv_tokens: int) -> None:
        from ouro_cli.engine.kv_cache import blocks_needed

        kv = self.llm.kv
        need = blocks_needed(min(n_prompt + 1, max_kv_tokens), self.llm.block_size)  # as the local scheduler admits
        if need > kv.allocator.num_free or not self.free_rows:
            self.conn.send((P.RESERVE_FAILED, rid, kv.allocator.num_free))
            return
        blocks = kv.allocator.allocate(need)
        row = self.free_rows.pop()
        self.reserved[rid] = (blocks, row, n_prompt)
        self.conn.send((P.RESERVED, rid, kv.slots(blocks, 0, n_prompt), row))

    def activate(self, rid: str, index: int, prompt: list[int], params: Any, max_kv_tokens: int) -> None:
        from ouro_cli.engine.request_rng import RequestRng
        from ouro_cli.engine.scheduler import Sequence

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
        llm = self.llm
        seq = Sequence(index=index, request_id=rid, prompt=list(prompt), params=params, rng=RequestRng(params.seed),
                       max_kv_tokens=max_kv_tokens, blocks=blocks, num_cached=n_prompt)
        self.sched.running.append(seq)
        self.conn.send((P.ACTIVATED, rid))
        t0 = time.perf_counter()
        llm._sample([seq], self.landing[row:row + 1].clone(), [llm.num_loops], self.sched)
        self.free_rows.append(row)
        c = self.counters
        c.transfers += 1
        c.bytes += n_prompt * llm.kv.bytes_per_token() + self.landing[row].numel() * self.landing.element_size()
        c.seconds += time.perf_counter() - t0
        self.report([seq])

    def step(self) -> None:
        llm, sched = self.llm, self.sched
        t0 = time.perf_counter()
        plan = sched.schedule()
        llm.counters.preemptions += len(plan.preempted)
        if not plan.prefill and not plan.decode:
            raise RuntimeError(f"the scheduler could not make progress (this is a bug): running "
                               f"{[(q.request_id, q.num_cached, len(q.blocks)) for q in sched.running]}, waiting "
                               f"{[q.request_id for q in sched.waiting]}, {llm.kv.allocator.num_free} blocks free")
        if plan.prefill:  # only sequences preempted here come back through prefill: recompute locally
            llm._prefill(plan.prefill, sched)
        if plan.decode:
            llm._decode(plan.decode, sched)
        self.counters.seconds += time.perf_counter() - t0
        self.report(plan.decode + plan.prefill)

    def report(self, seqs: list) -> None:
        new, finished = [], []
        for seq in seqs:
            done = self.reported.get(seq.request_id, 0)
            if len(seq.output) > done:
                new.append((seq.request_id, seq.output[done:], seq.depths[done:], seq.logprobs[done:]))
                self.counters.tokens += len(seq.output) - done
                self.reported[seq.request_id] = len(seq.output)
            if seq.finish_reason is not None:
                finished.append((seq.request_id, seq.finish_reason))
                self.reported.pop(seq.request_id, None)
        if new or finished:
            self.conn.send((P.TOKENS, new, finished, self.stats()))

    def cancel(self) -> None:
        aborted = []
        for seq in self.sched.drain():
            seq.finish_reason = "abort"
            aborted.append(seq)
        self.report(aborted)
        for blocks, row, _ in self.reserved.values():
            self.llm.kv.allocator.free(blocks)
            self.free_rows.append(row)
        dropped = list(self.reserved)
        self.reserved.clear()
        self.notified.clear()
        self.conn.send((P.CANCELLED, dropped, self.stats()))

    def drop_all(self) -> None:
        self.sched.drain()
        self.reserved.clear()
        self.notified.clear()
        self.free_rows = list(range(self.llm.max_num_seqs - 1, -1, -1))
