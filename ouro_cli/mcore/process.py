"""torch.distributed setup for one process, or for the ranks torchrun started."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ouro_cli import env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


@contextlib.contextmanager
def single_process_group(backend: str | None = None) -> Iterator[None]:
    """A world of one for tools (conversion, export) that call megatron's dist checkpointing.

    If a process group already exists (inside the trainer, under torchrun) it is used
    as is and left alone.
    """
    if dist.is_available() and dist.is_initialized():
        yield
        return
    dist.init_process_group(
        backend=backend or "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return env.launched_by_torchrun()


def launched_ranks() -> int:
    """The ranks torchrun started (1 without torchrun), known before the process group exists."""
    return env.world_size()
