"""The prefill/decode (PD) wire protocol: who sends what to whom, in which order.

Every message is one of the frozen dataclasses below; its fields are exactly what
travels. Three kinds of channel, all `multiprocessing` pipes (tensors in messages
travel as shared memory / CUDA IPC handles through torch.multiprocessing's reductions):

- coordinator (C) <-> each worker: the control messages;
- prefill worker (P) <-> decode worker (D), one pipe per pair: the transport's side
  channel — D's memory registration at start-up (`Register`) and, for transports
  without their own notifications (shared memory), the `Notify` that follows a KV write;
- the KV bytes themselves move through the transport (transport/), never through a
  pipe: P writes straight into D's registered KV blocks and landing row.

Start-up: each D sends `Register` to every P; every worker sends C `Ready`.

One request, in order (C never moves to a step before the previous step's answer
arrived, so no step can overtake another):

    C -> D  Reserve          D allocates KV blocks for the prompt and a landing row
    D -> C  Reserved         ... or ReserveFailed (no room now: C retries later)
    C -> P  Prefill          P prefills at full depth T into its own cache, WRITEs the K/V
                             planes of every prompt position into D's slots and the last
                             position's logits (what token 0 is sampled from) into D's
                             landing row, then notifies D (tag = rid)
    P -> C  Committed
    C -> D  Activate         D checks the notification arrived (bytes delivered, not just
                             sent), samples token 0 and starts decoding
    D -> C  Activated
    C -> P  Release          P frees its staging blocks
    D -> C  Tokens           after every step; D frees a finished request's blocks
                             before reporting it

Every worker -> C message that reports progress carries the worker's `WorkerStats`.

Pause: C -> D `Pause` holds D's steps until `Resume`. Cancellation: C -> P `Cancel` (P
answers `Cancelled` after the prefill in flight, so a late WRITE can never land in
blocks D already gave away), then C -> D `Cancel` (D ends everything with finish_reason
"abort", frees, reports the aborted requests in `Tokens`, answers `Cancelled`).

Publication: C -> every worker `StartUpdate` / `Update` / `FinishUpdate`; each answers
`Ok` or `Failed`; C commits only when all said ok.

Shutdown: C -> worker `Stop`; the worker answers `Stopped` and leaves its loop. A
worker that meets an exception sends `Error` and exits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ouro_cli.engine.contract import SamplingParams

PREFILL_ROLE = "prefill"
DECODE_ROLE = "decode"


@dataclass
class WorkerCounters:  # a worker's own (what `PDEngine.worker_counters` and `stop` report)
    tokens: int = 0  # P: prompt tokens prefilled; D: tokens sampled
    bytes: int = 0  # KV + logits bytes written (P) or received (D)
    transfers: int = 0
    seconds: float = 0.0  # busy time: model execution and transfers
    blocks_in_use: int = 0
    weight_version: int = 0


@dataclass(frozen=True)
class WorkerStats:  # carried by every report: the worker's counters and its core's work counters
    worker: WorkerCounters = field(default_factory=WorkerCounters)
    work: dict[str, int] = field(default_factory=dict)


# ---- coordinator -> worker (each class comment: who sends it to whom, what the receiver does)


@dataclass(frozen=True)
class Reserve:  # C -> D: reserve KV blocks for the prompt and a landing row for its logits
    rid: str
    n_prompt: int
    max_kv_tokens: int  # as the local scheduler admits: prompt + first token, at most this


@dataclass(frozen=True)
class Prefill:  # C -> P: prefill at full depth, write the K/V and the logits into D, notify D
    rid: str
    tokens: list[int]
    decoder: str  # D's name
    dst_slots: list[int]  # where `Reserved` said the prompt's K/V go
    row: int  # and the landing row of the last position's logits


@dataclass(frozen=True)
class Activate:  # C -> D: the KV was written; sample token 0 and decode the request
    rid: str
    index: int  # the request's position in its generate call
    prompt: list[int]
    params: SamplingParams  # the effective ones (K resolved, seed drawn)
    max_kv_tokens: int


@dataclass(frozen=True)
class Release:  # C -> P: D activated the request; free its staging blocks
    rid: str


@dataclass(frozen=True)
class Cancel:  # C -> P, then C -> D: drop every request (abort)
    pass


@dataclass(frozen=True)
class Pause:  # C -> D: take no step until `Resume`
    pass


@dataclass(frozen=True)
class Resume:  # C -> D: step again
    pass


@dataclass(frozen=True)
class StartUpdate:  # C -> every worker: start the weight update (the KV is invalidated)
    version: int


@dataclass(frozen=True)
class Update:  # C -> every worker: one chunk of the update, which C checked whole
    items: list[tuple[str, torch.Tensor]]  # (physical name, tensor)


@dataclass(frozen=True)
class FinishUpdate:  # C -> every worker: commit the update (every tensor arrived)
    pass


@dataclass(frozen=True)
class Stop:  # C -> every worker: answer `Stopped` and leave the loop
    pass


# ---- worker -> coordinator ------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:  # worker -> C, once after start-up (a P after every D registered)
    name: str
    pid: int
    device: str
    kv_blocks: int
    block_size: int
    transport: str


@dataclass(frozen=True)
class Reserved:  # D -> C: where the request's prompt K/V and token-0 logits go
    rid: str
    dst_slots: list[int]
    row: int


@dataclass(frozen=True)
class ReserveFailed:  # D -> C: no room now; C retries once a request on D finished
    rid: str
    free_blocks: int  # D's free blocks (there may also be no landing row free)


@dataclass(frozen=True)
class Committed:  # P -> C: the K/V and logits were written and D notified
    rid: str
    nbytes: int
    seconds: float  # of the transfer
    stats: WorkerStats


@dataclass(frozen=True)
class Activated:  # D -> C: the request runs on D (P may release it)
    rid: str


@dataclass(frozen=True)
class NewTokens:  # in `Tokens`: what one request generated since the last report
    rid: str
    ids: list[int]
    depths: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class Finished:  # in `Tokens`: a request that finished (its blocks already freed)
    rid: str
    reason: str


@dataclass(frozen=True)
class Tokens:  # D -> C after every step that produced tokens or finished requests
    new: list[NewTokens]
    finished: list[Finished]
    stats: WorkerStats


@dataclass(frozen=True)
class Cancelled:  # P or D -> C, answering `Cancel`: everything dropped
    dropped: list[str]  # the requests that never started there (queued for prefill, or reserved)
    stats: WorkerStats


@dataclass(frozen=True)
class Ok:  # worker -> C: a publication step succeeded
    version: int  # the committed version


@dataclass(frozen=True)
class Failed:  # worker -> C: a publication step was refused (generation blocked until a newer update)
    reason: str


@dataclass(frozen=True)
class Stopped:  # worker -> C, answering `Stop`: the final counters; the worker then exits
    stats: WorkerStats


@dataclass(frozen=True)
class Error:  # worker -> C: an exception; the worker exits
    where: str  # "start-up" or "running"
    message: str
    traceback: str


# ---- prefill worker <-> decode worker ---------------------------------------------------------


@dataclass(frozen=True)
class Register:  # D -> every P at start-up: D's transport registration (KV planes, landing rows)
    decoder: str
    registration: Any


@dataclass(frozen=True)
class Notify:  # P -> D after a write, for transports that do not notify themselves
    rid: str
