"""Process group and Megatron parallel state for the trainer: one process, or the ranks
`torchrun` started.

Backend: NCCL when the trainer runs on CUDA, gloo on CPU (a CPU run goes through the
same Megatron DDP / optimizer / checkpoint code as a GPU run). The model-parallel
sizes are fixed at TP = PP = CP = 1 (`TrainerConfig` rejects anything else), so every
rank is a data-parallel replica; `initialize_model_parallel` is still called with the
configured sizes so that tensor parallelism can be switched on here later.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ouro_cli import env
from ouro_cli.mcore.cpu_compat import megatron_on_cpu
from ouro_cli.mcore.process import free_port, launched_by_torchrun

from .config import TrainerConfig


@dataclass
class DistributedContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool  # True when the trainer created it (and destroys it on close)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# Whether `join_world` created the default process group for a trainer not built yet: that
# trainer then owns it (destroys it on close) as if it had created it.
_joined_early = [False]


def _local_device(device_type: str) -> torch.device:
    device = torch.device("cuda", env.local_rank()) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    return device


def join_world(device_type: str) -> None:
    """Create the default process group now, as the trainer would, for the ranks torchrun
    started (nothing for one process, or where a group exists): `ouro train` agrees on its
    memory plan across ranks before it builds the trainer, which the plan configures. The
    trainer built next takes the group over as its own."""
    if dist.is_initialized() or not launched_by_torchrun():
        return
    device = _local_device(device_type)
    dist.init_process_group(
        backend="nccl" if device_type == "cuda" else "gloo", device_id=device if device_type == "cuda" else None
    )
    _joined_early[0] = True


def leave_world() -> None:
    """Destroy the group `join_world` created if no trainer has taken it over (a run that stops
    before it builds its trainer)."""
    if _joined_early[0] and dist.is_initialized():
        dist.destroy_process_group()
    _joined_early[0] = False


def initialize(config: TrainerConfig) -> DistributedContext:
    """Create (or join) the default process group and Megatron's parallel state, then seed."""
    from megatron.core import parallel_state

    device_type = config.resolved_device
    local_rank = env.local_rank()
    device = _local_device(device_type)

    owns, _joined_early[0] = _joined_early[0] and dist.is_initialized(), False
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if launched_by_torchrun():
            dist.init_process_group(backend=backend, device_id=device if device_type == "cuda" else None)
        else:
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        owns = True

    with megatron_context(config):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tensor_parallel,
            pipeline_model_parallel_size=config.pipeline_parallel,
            context_parallel_size=config.context_parallel,
        )
        seed_everything(config.seed)
    return DistributedContext(dist.get_rank(), dist.get_world_size(), local_rank, device, owns)


def megatron_context(config: TrainerConfig):
    """The scope in which Megatron code runs: the CPU compatibility layer for a CPU trainer
    (even on a machine that has a GPU), nothing at all for a CUDA trainer."""
    return megatron_on_cpu(enabled=config.resolved_device == "cpu")


def seed_everything(seed: int) -> None:
    """Python, NumPy, torch (CPU and CUDA) and Megatron's model-parallel RNG tracker.

    All ranks get the same seed: they hold replicas of one model, and the trainer itself
    draws no random numbers (no dropout in Ouro); rollout sampling seeds per request.
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)  # seeds CUDA (or its CPU stand-in) too


def shutdown(context: DistributedContext) -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if context.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
