"""Per-update fingerprints of the training state.

`state_digest` (for bitwise resume verification, `--state-digest`): sha256 over the raw
bytes of every model parameter and every tensor in the optimizer's state dict (fp32 main
weights, both Adam moments, step counts), walked in a fixed order. Under data
parallelism each rank hashes what it holds and the rank digests are hashed together, so
the value is the same on every rank.

`params_sha256` (the cross-rank check after every update): sha256 over the name, dtype,
shape and raw bytes of every model tensor this rank holds, with no communication. Data-
parallel replicas must agree on it bit for bit; the caller gathers and compares. The
optimizer state is left out on purpose: with the distributed optimizer each rank holds
a different shard of it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _feed(h, item)
    else:
        h.update(repr(value).encode())


def _feed_params(h: Any, trainer) -> None:
    for name, tensor in trainer.named_weights_for_publication():
        h.update(name.encode())
        _feed(h, tensor)


def params_sha256(trainer) -> str:
    h = hashlib.sha256()
    _feed_params(h, trainer)
    return h.hexdigest()


def state_digest(trainer) -> str:
    h = hashlib.sha256()
    _feed_params(h, trainer)
    with trainer.megatron_context():
        optimizer_state = trainer.optimizer.state_dict()
    _feed(h, optimizer_state)
    local = h.hexdigest()
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        return hashlib.sha256("".join(parts).encode()).hexdigest()
    return local
