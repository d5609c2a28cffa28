"""The stages of an update as measured phases: wall time, peak device memory, and an
out-of-memory failure turned into one line that names the phase, its size and the option
to lower.

    with phase(metrics, "train", device, f"{n} micro-batches of up to {t} tokens",
               "--max-tokens-per-micro-batch"):
        trainer.train_step(batch)

records `train_s`, `train_compile_s` (the part of it spent compiling),
`peak_memory_train_gib` (the most memory the process's tensors took at once: PyTorch's
allocated bytes plus the KV cache's memory outside its allocator), `peak_held_train_gib` (the
most it held from the device at once: PyTorch's reserved segments, its cached blocks and
CUDA-graph pools included, plus the KV cache; engine/kv_memory.py `peak_bytes`),
`memory_outside_gib` (what the device has in use beyond that at the phase's end: the CUDA
context, and any other process), `graph_pools_gib` (what the CUDA-graph pools hold at its end,
part of the held figure; rl/allocator.py) and `train_alloc_retries` (allocations that made the
allocator free its cache and ask the device again: a phase near its memory limit) in
`metrics`. The memory figures are CUDA's (None on CPU): the peak plus the memory outside is
what the memory plan's budget must hold (rl/sizing.py). A GPU error (an illegal address, a
device-side assert) raises `DeviceFault` naming the phase. An OOM raises `ResourceError`
(exit 1): nothing of the update has been saved, so the last checkpoint stays the latest.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from ouro_cli.errors import DeviceFault, ResourceError, device_fault_line, is_device_fault

from . import allocator

GIB = 2**30


@contextlib.contextmanager
def phase(metrics: dict[str, Any], name: str, device: torch.device, size: str, lower: str) -> Iterator[None]:
    from ouro_cli.model.compiling import compile_seconds

    cuda = device.type == "cuda"
    if cuda:
        from ouro_cli.engine import kv_memory

        kv_memory.reset_peak(allocator.device_index(device))
    retries = _alloc_retries(device) if cuda else None
    start, compiled = time.perf_counter(), compile_seconds()
    faulted = False
    try:
        yield
    except torch.OutOfMemoryError as err:
        if cuda:
            torch.cuda.empty_cache()
        where = "GPU" if cuda else "host"
        raise ResourceError(f"out of {where} memory in the {name} phase ({size}); lower {lower}") from err
    except Exception as err:
        if not is_device_fault(err):
            raise
        faulted = True  # the context is lost: no more CUDA calls, the memory figures included
        raise DeviceFault(device_fault_line(f"the {name} phase ({size})", err)) from err
    finally:
        metrics[f"{name}_s"] = time.perf_counter() - start
        metrics[f"{name}_compile_s"] = compile_seconds() - compiled
        cuda = cuda and not faulted
        needed, held = _peak_bytes(device) if cuda else (None, None)
        metrics[f"peak_memory_{name}_gib"] = needed / GIB if cuda else None
        metrics[f"peak_held_{name}_gib"] = held / GIB if cuda else None
        if cuda:
            metrics["memory_outside_gib"] = allocator.outside_bytes(device) / GIB
            metrics["graph_pools_gib"] = allocator.graph_pool_bytes(allocator.device_index(device)) / GIB
        metrics[f"{name}_alloc_retries"] = _alloc_retries(device) - retries if cuda else None


def _peak_bytes(device: torch.device) -> tuple[int, int]:
    from ouro_cli.engine import kv_memory

    return kv_memory.peak_bytes(allocator.device_index(device))


def _alloc_retries(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def hand_back(engine: Any, device: torch.device) -> None:
    """Let the trainer use the engine's KV memory until the next rollout (contract.ReleasesMemory);
    the allocator's cached blocks go back to the device so either side can take them whole."""
    from ouro_cli.engine.contract import ReleasesMemory

    if isinstance(engine, ReleasesMemory):
        engine.release_memory()
    if device.type == "cuda":
        torch.cuda.empty_cache()
