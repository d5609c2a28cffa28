"""KV transports: how a prefill worker's K/V planes and logits reach a decode worker's blocks.

Both transports are one-sided WRITEs into memory the decode worker registered, followed
by a notification the decode worker checks before it activates the request, so
"delivered" is observed on the receiving side, never inferred from the sender's
completion:

- `nixl`: NIXL with the UCX backend (VRAM on CUDA, DRAM on CPU); works across hosts
  and is what GPU deployments use. Needs the `nixl` wheel (`pip install nixl`).
- `shm`: the fallback for one host without NIXL — the decode worker's KV tensors live
  in shared memory (CPU) or are shared by CUDA IPC, the prefill worker maps them and
  copies into the reserved slots; the notification travels over the P–D pipe after
  the copy returned.

`select_transport("auto")` takes nixl when it imports and shm otherwise; the choice is
exposed as `PDEngine.transport` so metrics record which one moved the bytes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ouro_cli.engine.contract import EngineError

TRANSPORTS = ("auto", "nixl", "shm")
NIXL_INSTALL_HINT = "pip install nixl  (the UCX backend ships in the wheel; or build NIXL with UCX)"


class KVTransport(Protocol):
    name: str
    notifies_itself: bool  # False: P sends a protocol.Notify over the P–D pipe after write()

    def register(self, k: torch.Tensor, v: torch.Tensor, landing: torch.Tensor) -> Any:
        """Decode side: make the KV planes and landing rows writable by peers; a picklable registration."""

    def connect(self, peer: str, registration: Any) -> None:
        """Prefill side: remember how to write into `peer`'s registered memory."""

    def write(
        self,
        peer: str,
        k: torch.Tensor,
        v: torch.Tensor,
        src_slots: list[int],
        dst_slots: list[int],
        logits: torch.Tensor,
        row: int,
        tag: str,
    ) -> int:
        """Copy K/V of `src_slots` (every layer, plane, head) into `peer`'s `dst_slots`, and
        `logits` into its landing `row`; returns when the write completed; bytes moved."""

    def delivered(self) -> list[str]:
        """Decode side: tags of writes whose notification arrived since the last call."""

    def close(self) -> None: ...


def nixl_available() -> bool:
    try:
        import nixl  # noqa: F401
        from nixl._api import nixl_agent  # noqa: F401
    except Exception:  # noqa: BLE001 — a broken install is "not available", reported by the probe
        return False
    return True


def resolve_transport_name(name: str) -> str:
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    if name == "auto":
        return "nixl" if nixl_available() else "shm"
    if name == "nixl" and not nixl_available():
        raise EngineError(f"transport 'nixl' asked for but NIXL is not installed: {NIXL_INSTALL_HINT}")
    return name


def make_transport(name: str, agent_name: str) -> KVTransport:
    if name == "nixl":
        from .nixl import NixlTransport

        return NixlTransport(agent_name)
    if name == "shm":
        from .shm import SharedMemoryTransport

        return SharedMemoryTransport()
    raise ValueError(f"unknown transport {name!r}")
