"""The device time of a decode step's parts, measured in the stream by CUDA events.

A decode step queues its forward (the captured graph, or the eager step) and then the
sampling of its tokens (log-softmax, the draw, the argmax, the copy back). `StepSpans`
records an event before the forward, one after it and one after the sampling; once the
step's tokens are read (core.finish_step), the two intervals are the device time each
part took, including any gap in which the device waited for the host to queue it. Summed
over a rollout (`decode_forward_gpu_us`, `decode_sample_gpu_us`) beside the host's waits
for tokens (`token_wait_us`), they say whether a slow decode step is the graph, the
sampling, or the host. Timing only: the events change nothing that is computed. Off CUDA
there is nothing to record.
"""

from __future__ import annotations

import torch


class StepSpans:
    """Events around one decode step's forward and sampling (`begin`, then `mark` after each)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: list[torch.cuda.Event] = []
        self.mark()

    @classmethod
    def begin(cls, device: torch.device) -> StepSpans | None:
        return cls(device) if device.type == "cuda" else None

    def mark(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self.events.append(event)

    def elapsed_us(self) -> list[int]:
        """Microseconds between consecutive marks; waits for the last one (queued right after
        the step's copy of its tokens, which the caller has already waited for)."""
        self.events[-1].synchronize()
        return [round(a.elapsed_time(b) * 1e3) for a, b in zip(self.events, self.events[1:], strict=False)]
