"""Whole conversions between formats, as published artifacts (used by `ouro convert` and `ouro export`).

A conversion reads an already validated source (`sources.open_checkpoint`) and writes
its output through the output guard (ouro_cli/outputs.py `staged_output`): the weights,
config and assets, then `manifest.json`, then the COMPLETE marker, in a staging directory
that replaces OUT only when all of that succeeded, while the conversion holds OUT's lock.
An OUT the guard refuses (overlapping what the conversion reads, inside a run's own files,
not empty without `overwrite`) is refused before anything is written. Tensors pass through
untouched (no dtype change), one at a time wherever the target format allows it. An HF
directory made from a run's checkpoint that trained with an fp8 KV cache says so
(trained_with.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ouro_cli import artifacts, outputs

from . import layout
from .hf import DEFAULT_MAX_SHARD_BYTES, write_hf
from .megatron import save_megatron
from .names import parameter_count
from .sources import CheckpointSource
from .trained_with import trained_with, write_note

OnTensor = Callable[[str, torch.Tensor], None]


def to_megatron(
    source: CheckpointSource,
    out: Path,
    *,
    iteration: int | str = layout.RELEASE,
    overwrite: bool = False,
    command: str,
    options: dict[str, Any],
    on_tensor: OnTensor | None = None,
) -> dict[str, Any]:
    """Write `source` as a Megatron dist checkpoint at `out` (with hf_assets/ for export)."""
    start = time.perf_counter()
    with outputs.staged_output(Path(out), overwrite=overwrite, command=command, inputs=source.input_paths) as staging:
        save_megatron(
            staging,
            source.config,
            source.iter_tensors(),
            iteration=iteration,
            assets_from=source.assets_dir,
            on_tensor=on_tensor,
        )
        artifacts.write_manifest(staging, command, options, source.input_paths)
        artifacts.mark_complete(staging)
    return _summary(source, out, "megatron", start, iteration=str(iteration))


def to_hf(
    source: CheckpointSource,
    out: Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    command: str,
    options: dict[str, Any],
    on_tensor: OnTensor | None = None,
) -> dict[str, Any]:
    """Write `source` as a Hugging Face directory at `out`, loadable with the original remote code;
    with the note of what it was trained with, where that changed the policy (`trained_with`)."""
    start = time.perf_counter()
    trained = trained_with(Path(source.path))
    noted = {"trained_with": trained} if trained else {}
    with outputs.staged_output(Path(out), overwrite=overwrite, command=command, inputs=source.input_paths) as staging:
        written = write_hf(
            staging,
            source.config,
            source.iter_tensors(),
            max_shard_bytes=max_shard_bytes,
            assets_from=source.assets_dir,
            specs=source.specs,
            on_tensor=on_tensor,
        )
        write_note(staging, trained)
        artifacts.write_manifest(staging, command, {**options, **noted}, source.input_paths)
        artifacts.mark_complete(staging)
    return _summary(source, out, "hf", start, files=written.files, assets=written.assets, **noted)


def _summary(source: CheckpointSource, out: Path, fmt: str, start: float, **extra: Any) -> dict[str, Any]:
    specs = source.specs
    return {
        "input": str(Path(source.path).resolve()),
        "input_format": source.kind,
        "output": str(Path(out).resolve()),
        "output_format": fmt,
        "tensors": len(specs),
        "parameters": parameter_count(s.shape for s in specs.values()),
        "bytes": sum(s.nbytes for s in specs.values()),
        "dtypes": sorted({str(s.dtype).removeprefix("torch.") for s in specs.values()}),
        "seconds": round(time.perf_counter() - start, 3),
        **extra,
    }
