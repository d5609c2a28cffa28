"""Weight publication into a live model, exactly as docs/model.md §5 requires.

    start(version) -> update(chunk)* -> finish()

- A version must exceed every version ever attempted on this engine (not just the
  committed one), so a retried or interleaved publisher can never reuse a number.
- Names are physical HF names; wrapper prefixes (`module.`, `language_model.`) are
  stripped. A chunk is checked whole — duplicates (in the chunk or already received),
  unknown names, shape mismatches — before any tensor is copied, so a bad chunk
  changes nothing.
- Tensors are copied into the existing parameters: storage addresses never change, so
  anything holding them (captured CUDA graphs) stays valid. A chunk is copied with one
  fused multi-tensor copy per (source device, dtype) group (`torch._foreach_copy_`,
  `copy_` semantics: dtype conversion, any device); a source on the parameters' device
  is copied there directly, never through the host.
- `finish` commits only when every physical tensor arrived exactly once.
- Any failure (a rejected chunk, an incomplete finish) leaves the model in an unknown
  mix of versions: generation stays blocked until a newer update completes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .contract import GenerationBlocked, PublicationError

WRAPPER_PREFIXES = ("module.", "language_model.")


def physical_name(name: str) -> str:
    """`name` with any leading wrapper prefixes removed (`module.language_model.x` -> `x`)."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    return name


@torch.no_grad()
def copy_into(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """`dst.copy_(src)` for every pair, fused: one multi-tensor copy per group of pairs that
    share source device and dtypes. Few large launches instead of one per tensor (a 1.4B
    model has ~220 tensors, many of them small norm weights); torch falls back to per-tensor
    `copy_` inside a group when strides differ, so semantics are `copy_`'s either way."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        d, s = groups.setdefault((dst.device, dst.dtype, src.device, src.dtype), ([], []))
        d.append(dst)
        s.append(src)
    for d, s in groups.values():
        torch._foreach_copy_(d, s)


class WeightPublisher:
    def __init__(self, model: nn.Module, version: int = 0) -> None:
        self.params = dict(model.named_parameters())
        self.committed_version = version
        self.max_attempted = version
        self.pending: int | None = None
        self.received: set[str] = set()
        self.blocked_reason: str | None = None

    @property
    def in_progress(self) -> bool:
        return self.pending is not None

    def check_usable(self) -> None:
        if self.in_progress:
            raise GenerationBlocked(f"weight update to version {self.pending} is in progress")
        if self.blocked_reason is not None:
            raise GenerationBlocked(
                f"weights are not a committed version ({self.blocked_reason}); "
                "publish a complete update with a newer version first"
            )

    def start(self, version: int) -> None:
        if not isinstance(version, int) or isinstance(version, bool):
            raise PublicationError(f"version must be an int, got {version!r}")
        if self.in_progress:
            raise PublicationError(f"an update to version {self.pending} is already in progress")
        if version <= self.max_attempted:
            raise PublicationError(
                f"version {version} is not greater than every version attempted so far (max {self.max_attempted})"
            )
        self.max_attempted = version
        self.pending = version
        self.received = set()
        self.blocked_reason = f"update to version {version} not finished"

    def update(self, chunk: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self.in_progress:
            raise PublicationError("update_weights called without start_weight_update")
        items = [(physical_name(name), tensor) for name, tensor in chunk]
        try:
            self._check(items)
        except PublicationError as err:
            self.fail(str(err))
            raise
        copy_into([self.params[name] for name, _ in items], [tensor for _, tensor in items])
        self.received.update(name for name, _ in items)

    def finish(self) -> int:
        if not self.in_progress:
            raise PublicationError("finish_weight_update called without start_weight_update")
        missing = sorted(set(self.params) - self.received)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            self.fail(f"update to version {self.pending} is missing {len(missing)} tensors: {shown}")
            raise PublicationError(self.blocked_reason)
        self.committed_version, self.pending, self.blocked_reason = self.pending, None, None
        return self.committed_version

    def _check(self, items: list[tuple[str, torch.Tensor]]) -> None:
        seen: set[str] = set()
        for name, tensor in items:
            if name not in self.params:
                raise PublicationError(f"unknown tensor name {name!r}")
            if name in seen or name in self.received:
                raise PublicationError(f"tensor {name!r} sent more than once")
            seen.add(name)
            if not isinstance(tensor, torch.Tensor):
                raise PublicationError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            if tuple(tensor.shape) != tuple(self.params[name].shape):
                raise PublicationError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(self.params[name].shape)}"
                )

    def fail(self, reason: str) -> None:
        """End the update in progress as failed: generation stays blocked until a newer one commits."""
        self.blocked_reason = f"update to version {self.pending} failed: {reason}"
        self.pending = None
