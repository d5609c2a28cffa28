"""The NIXL KV transport: one-sided UCX WRITEs from the prefill worker into the decode worker's blocks.

Each worker is a NIXL agent with the UCX backend. The decode worker registers its K
and V planes and its landing rows (VRAM on CUDA, DRAM on CPU) and sends its agent
metadata plus the base addresses and layout to every prefill worker over the P–D
pipe. A write turns the request's (src slot, dst slot) pairs into runs of consecutive
slots and emits one descriptor per (layer, plane, kv head, run) — a run is contiguous
in the head-major layout [L, T, Hkv, slots, D] — plus one for the logits, posts a
single WRITE with the request id as its notification, and waits for completion. The
decode worker activates the request only after NIXL delivered that notification,
which UCX orders after the data.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch


def _mem(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)


class NixlTransport:
    name = "nixl"
    notifies_itself = True

    def __init__(self, agent_name: str, timeout: float = 120.0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(agent_name, nixl_agent_config(backends=["UCX"]))
        self.timeout = timeout
        self.peers: dict[str, dict[str, Any]] = {}
        self.local: dict[int, Any] = {}  # data_ptr -> registration of local memory written from
        self.stage: torch.Tensor | None = None

    # ---- decode side --------------------------------------------------------------------

    def register(self, k: torch.Tensor, v: torch.Tensor, landing: torch.Tensor) -> Any:
        self.agent.register_memory([k, v, landing])
        mem, dev = _mem(k)
        return {
            "meta": self.agent.get_agent_metadata(),
            "k": k.data_ptr(),
            "v": v.data_ptr(),
            "landing": landing.data_ptr(),
            "landing_row_bytes": landing.stride(0) * landing.element_size(),
            "shape": tuple(k.shape),
            "elt": k.element_size(),
            "mem": mem,
            "dev": dev,
        }

    def delivered(self) -> list[str]:
        return [m.decode() for msgs in self.agent.get_new_notifs().values() for m in msgs]

    # ---- prefill side -------------------------------------------------------------------

    def connect(self, peer: str, registration: Any) -> None:
        self.peers[peer] = {**registration, "agent": self.agent.add_remote_agent(registration["meta"])}

    def _register_local(self, *tensors: torch.Tensor) -> None:
        new = [t for t in tensors if t.data_ptr() not in self.local]
        if new:
            self.agent.register_memory(new)
            self.local.update({t.data_ptr(): True for t in new})

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
        remote = self.peers[peer]
        if self.stage is None or self.stage.numel() != logits.numel() or self.stage.dtype != logits.dtype:
            self.stage = torch.empty_like(logits)
        self.stage.copy_(logits)
        self._register_local(k, v, self.stage)
        if k.is_cuda:
            torch.cuda.synchronize(k.device)
        L, T, H, s_src, D = k.shape
        s_dst = remote["shape"][3]
        elt = k.element_size()
        runs = _runs(src_slots, dst_slots)  # [R, 3]: src start, dst start, length
        lth = np.arange(L * T * H, dtype=np.int64)[:, None]
        src_off = ((lth * s_src + runs[None, :, 0]) * D * elt).reshape(-1)
        dst_off = ((lth * s_dst + runs[None, :, 1]) * D * elt).reshape(-1)
        length = np.broadcast_to(runs[None, :, 2] * D * elt, (L * T * H, len(runs))).reshape(-1)
        mem, dev = _mem(k)
        local_rows, remote_rows = [], []
        for src_base, dst_base in ((k.data_ptr(), remote["k"]), (v.data_ptr(), remote["v"])):
            local_rows.append(np.stack([src_base + src_off, length, np.full_like(length, dev)], axis=1))
            remote_rows.append(np.stack([dst_base + dst_off, length, np.full_like(length, remote["dev"])], axis=1))
        nbytes_logits = self.stage.numel() * self.stage.element_size()
        local_rows.append(np.array([[self.stage.data_ptr(), nbytes_logits, dev]], dtype=np.int64))
        remote_rows.append(
            np.array(
                [[remote["landing"] + row * remote["landing_row_bytes"], nbytes_logits, remote["dev"]]], dtype=np.int64
            )
        )
        local = self.agent.get_xfer_descs(np.concatenate(local_rows), mem)
        dst = self.agent.get_xfer_descs(np.concatenate(remote_rows), remote["mem"])
        handle = self.agent.initialize_xfer("WRITE", local, dst, remote["agent"], tag.encode())
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL WRITE of request {tag} to {peer} did not complete in {self.timeout} s")
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL WRITE of request {tag} to {peer} failed (state {state})")
        finally:
            self.agent.release_xfer_handle(handle)
        return int(2 * length.sum()) + nbytes_logits

    def close(self) -> None:
        self.peers.clear()


def _runs(src: list[int], dst: list[int]) -> np.ndarray:
    """Maximal runs where both slot sequences advance by one: rows (src start, dst start, length)."""
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(s)]])
    return np.stack([s[starts], d[starts], ends - starts], axis=1)
