"""The shared-memory KV transport: the fallback for one host without NIXL.

The decode worker moves its KV tensors and landing rows into shared memory (CPU;
CUDA tensors are shared by CUDA IPC as they are) and sends them to each prefill
worker over the P–D pipe; torch.multiprocessing turns them into handles to the same
memory there. A write is an `index_copy_` into the reserved slots of every (layer,
plane, head) — one-sided, like an RDMA WRITE — and the notification follows on the
pipe only after the copy returned (and, on CUDA, synchronised), so a decode worker
that saw the notification reads complete bytes.
"""

from __future__ import annotations

from typing import Any

import torch


class SharedMemoryTransport:
    name = "shm"
    notifies_itself = False

    def __init__(self) -> None:
        self.peers: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def register(self, k: torch.Tensor, v: torch.Tensor, landing: torch.Tensor) -> Any:
        for t in (k, v, landing):
            if t.device.type == "cpu":
                t.share_memory_()
        return {"k": k, "v": v, "landing": landing}

    def connect(self, peer: str, registration: Any) -> None:
        self.peers[peer] = (registration["k"], registration["v"], registration["landing"])

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
        dst_k, dst_v, landing = self.peers[peer]
        src = torch.tensor(src_slots, dtype=torch.long, device=k.device)
        dst = torch.tensor(dst_slots, dtype=torch.long, device=dst_k.device)
        moved = 0
        for s, d in ((k, dst_k), (v, dst_v)):
            block = s.index_select(3, src).to(d.device)  # [L, T, Hkv, n, D]
            d.index_copy_(3, dst, block)
            moved += block.numel() * block.element_size()
        landing[row].copy_(logits.to(landing.device, landing.dtype))
        moved += logits.numel() * landing.element_size()
        if dst_k.is_cuda:
            torch.cuda.synchronize(dst_k.device)
        return moved

    def delivered(self) -> list[str]:
        return []  # notifications come over the pipe (notifies_itself = False)

    def close(self) -> None:
        self.peers.clear()
