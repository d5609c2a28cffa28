"""Host values to the device, and device values back, without waiting for the device's queued work.

`torch.tensor(values, device="cuda")` copies synchronously: the host waits until every
kernel queued before it has run, so a decode step's sampling could be launched only once
the step had finished, and a train step's micro-batch only once the last backward had.
Shared by the engine and the trainer (trainer/batching.py `MicroBatch.to`).
Here the values are staged in pinned memory and copied asynchronously, in stream order;
PyTorch's caching host allocator keeps the staging buffer until the copy has run.

`HostCopy` is the way back: a step's sampled tokens are copied to pinned memory behind an
event, so the host can queue the next step before it waits for them (core.py, overlap).
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` (or the host tensor `values`) on `device`; queued, not
    waited for, on CUDA."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to the host: `values()` waits for this copy only
    (on CUDA an event recorded after it), not for work queued on the device later."""

    def __init__(self, x: torch.Tensor) -> None:
        if x.device.type != "cuda":
            self.host, self.ready = x, None
            return
        self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        self.host.copy_(x, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(x.device))

    def values(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
