"""Bit-reproducible gradients on CUDA: the trainer's forward and backward run with
PyTorch's deterministic algorithms.

Without them a CUDA step is not a function of its inputs: some CUDA backward kernels
(SDPA's memory-efficient backward, which the masked packed replay uses, among them)
accumulate with atomics in an order that changes from run to run, and a fresh-process
resume, or a prefill/decode run compared with a local one (`ouro verify-resume
--compare`), could not match bit for bit (tests/unit/trainer/test_gpu_step.py checks it).

The switch is scoped to the trainer's step, not set for the process: the engine shares
the process and its CUDA-graph capture must not meet the deterministic variants of
indexing ops (some synchronise). `fill_uninitialized_memory` stays off: filling every
`torch.empty` with NaN costs time and changes no result. CPU steps are deterministic
already and run unchanged. The flag itself is process-wide: `ouro train` samples and
trains in turn, but an engine decoding in another thread while a step runs would see it
too (where an op has a deterministic variant its bits may differ, and a CUDA-graph
capture could meet it); give such a trainer `TrainerConfig(deterministic=False)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ouro_cli import env

# cuBLAS is reproducible only with a fixed workspace per stream. PyTorch gives every
# (handle, stream) its own workspace, sized from CUBLAS_WORKSPACE_CONFIG, or by default 32 MiB
# on compute capability 9, 10 and 12 (Hopper and later), which is what ":4096:8" asks for.
# There the variable is left unset: PyTorch re-reads it with a regular expression at every
# matmul, which costs host time in every step (why: docs/performance.md#train). Older GPUs,
# whose default is smaller, still get the variable.
CUBLAS_WORKSPACE = ":4096:8"
DEFAULT_32MIB_MAJORS = (9, 10, 12)


def _set_cublas_workspace(device: torch.device) -> None:
    if torch.cuda.get_device_capability(device)[0] not in DEFAULT_32MIB_MAJORS:
        env.set_default("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


@contextlib.contextmanager
def deterministic_kernels(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """Within the block, CUDA ops pick their deterministic implementations (ops that have
    none warn once, they do not fail)."""
    if not enabled or device.type != "cuda":
        yield
        return
    _set_cublas_workspace(device)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    fill_before = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill_before
