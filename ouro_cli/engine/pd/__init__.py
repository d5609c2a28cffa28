"""Prefill/decode disaggregation: the rollout contract served by spawned P and D workers.

    from ouro_cli.engine.pd import make_pd_engine
    engine = make_pd_engine(model, prefill_devices=[0], decode_devices=[1], max_num_seqs=1)
    engine.transport     # "nixl" or "shm": which KV transport moved the bytes
    engine.devices()     # the distinct devices used, for device-hours
    engine.stop()        # stop/stopped handshake -> per-worker counters

Modules: protocol (the messages and their order), coordinator (`PDEngine`, in the
trainer process), worker (the spawned P and D processes), transport/ (NIXL over UCX,
and the shared-memory fallback).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .coordinator import PDEngine, WorkerFailed
from .transport import NIXL_INSTALL_HINT, nixl_available


def make_pd_engine(
    model: Any, prefill_devices: Sequence[int] = (0,), decode_devices: Sequence[int] = (1,), **engine_options: Any
) -> PDEngine:
    """An engine factory (`factory(model, **options)`) for `ouro train --prefill-devices/--decode-devices`
    (`PDEngine`'s options; the KV transport `transport=`, default "auto")."""
    return PDEngine(model, prefill_devices=list(prefill_devices), decode_devices=list(decode_devices), **engine_options)


__all__ = ["NIXL_INSTALL_HINT", "PDEngine", "WorkerFailed", "make_pd_engine", "nixl_available"]
