"""The prefill/decode (PD) wire protocol: who sends what to whom, in which order.

Three kinds of channel, all `multiprocessing` pipes (tensors in messages travel as
shared memory / CUDA IPC handles through torch.multiprocessing's reductions):

- coordinator <-> each worker: control messages below, tuples `(tag, *fields)`;
- prefill worker <-> decode worker (one pipe per pair): the transport's side
  channel — the decode worker's memory registration at start-up and, for transports
  without their own notifications (shared memory), the "delivered" notification
  that follows a KV write;
- the KV bytes themselves move through the transport (transport/), never through a
  pipe: P writes straight into D's registered KV blocks and landing row.

One request, in order (the coordinator never moves to a step before the previous
step's answer arrived, so no step can overtake another):

    C -> D  reserve(rid, n_prompt, max_kv_tokens)   D allocates KV blocks for the prompt
    D -> C  reserved(rid, dst_slots, row)            ... and a landing row for the logits
            | reserve_failed(rid)                    (no room now: C retries later)
    C -> P  prefill(rid, tokens, d_name, dst_slots, row)
            P prefills at full depth T into its own cache, WRITEs the K/V planes of every
            prompt position into D's slots and the last position's logits (what token 0
            is sampled from) into D's landing row, then notifies D (tag = rid).
    P -> C  committed(rid, nbytes, seconds)
    C -> D  activate(rid, params, prompt)            D checks the notification arrived
                                                     (bytes delivered, not just "sent"),
                                                     samples token 0 and starts decoding
    D -> C  activated(rid)
    C -> P  release(rid)                             P frees its staging blocks
    D -> C  tokens([(rid, ids, depths, logprobs)], [(rid, finish_reason)], counters)
                                                     after every step; D frees a finished
                                                     request's blocks before reporting it

Cancellation: C -> P cancel (P answers `cancelled` after the prefill in flight, so a
late WRITE can never land in blocks D already gave away), then C -> D cancel (D ends
everything with finish_reason "abort", frees, answers `cancelled`).

Publication: C -> every worker start(version) / update(items) / finish(); each
answers `ok` or `failed(reason)`; the coordinator commits only when all said ok.

Shutdown: C -> worker stop; worker -> C stopped(counters) and exits its loop. A
worker that meets an exception sends error(where, message) and exits.
"""

from __future__ import annotations

# coordinator -> worker
RESERVE = "reserve"
PREFILL = "prefill"
ACTIVATE = "activate"
RELEASE = "release"
CANCEL = "cancel"
PAUSE = "pause"
RESUME = "resume"
START_UPDATE = "start"
UPDATE = "update"
FINISH_UPDATE = "finish"
STOP = "stop"

# worker -> coordinator
READY = "ready"
RESERVED = "reserved"
RESERVE_FAILED = "reserve_failed"
COMMITTED = "committed"
ACTIVATED = "activated"
TOKENS = "tokens"
CANCELLED = "cancelled"
OK = "ok"
FAILED = "failed"
STOPPED = "stopped"
ERROR = "error"

# prefill worker <-> decode worker
REGISTER = "register"
NOTIFY = "notify"

PREFILL_ROLE = "prefill"
DECODE_ROLE = "decode"
