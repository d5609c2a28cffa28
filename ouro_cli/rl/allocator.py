"""How a colocated run sets up PyTorch's CUDA allocator, and what it reads back from it.

Two settings make the memory plan's budget (rl/sizing.py) hold for the memory the process
really takes from the device, not only for its tensors:

- Expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, unless the user set
  that variable): the train phase's micro-batches come in many sizes, and the allocator's
  fixed segments, each cut for its first request, leave holes that no later request fits.
  Expandable segments grow one mapped range per stream instead, so what the allocator holds
  stays close to what the tensors take. The PD engine shares CUDA tensors between processes
  (CUDA IPC), which such segments may not support: a disaggregated run keeps the default.
- The budget as the allocator's cap (`torch.cuda.set_per_process_memory_fraction`): a request
  that would take PyTorch's holdings past the budget first makes the allocator give its
  cached blocks back and try again, and only then fails as an out-of-memory that the run
  survives (rl/recovery.py). The KV cache's own mapped memory (engine/kv_memory.py) is
  outside the allocator, and is handed back before every train step.

Neither changes what a run computes; `settings` says which are in force, for the log.
"""

from __future__ import annotations

import torch

from ouro_cli import env

EXPANDABLE = "expandable_segments:True"


def prepare(*, disaggregated: bool) -> None:
    """Before the run's first CUDA allocation: expandable segments, unless the user configured
    the allocator or the run is disaggregated (module docstring)."""
    if disaggregated or env.is_set("PYTORCH_CUDA_ALLOC_CONF") or not torch.cuda.is_available():
        return
    env.set_default("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE)
    if torch.cuda.is_initialized():  # the allocator read its settings already: tell it directly
        torch.cuda.memory._set_allocator_settings(EXPANDABLE)


def cap(device: torch.device, budget_bytes: int, runtime_reserve: int) -> None:
    """Make the most PyTorch's allocator may hold on CUDA `device` the budget less the plan's
    runtime reserve (or what the process holds outside the allocator now, where that is more:
    the CUDA context, the libraries' own memory), so that the process as a whole stays within
    `budget_bytes` while the KV cache is handed back."""
    if device.type != "cuda":
        return
    _, total = torch.cuda.mem_get_info(device)
    allowed = max(0, budget_bytes - max(runtime_reserve, outside_bytes(device)))
    torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), device)


def outside_bytes(device: torch.device) -> int:
    """Device memory in use that neither PyTorch's allocator nor the KV cache holds: the CUDA
    context, libraries' own allocations, and any other process's."""
    from ouro_cli.engine import kv_memory

    free, total = torch.cuda.mem_get_info(device)
    index = device_index(device)
    return max(0, total - free - torch.cuda.memory_reserved(index) - kv_memory.mapped_bytes(index))


def device_index(device: torch.device) -> int:
    """The index of CUDA `device` (the current device where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def settings() -> str:
    """The allocator settings in force, as the log shows them."""
    return env.get("PYTORCH_CUDA_ALLOC_CONF") or "PyTorch's defaults"


def graph_pool_bytes(index: int) -> int:
    """What CUDA-graph memory pools hold on device `index`: the segments of every private pool
    (the engine's captured decode steps and prefills keep theirs for as long as they live, and
    no other allocation can use them)."""
    return sum(
        segment["total_size"]
        for segment in torch.cuda.memory_snapshot()
        if segment.get("device") == index and tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
    )
