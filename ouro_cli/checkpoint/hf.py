"""Hugging Face Ouro directories: read them lazily, write them as a stream.

Reading validates everything that can be checked without loading weights — config,
index, every safetensors header (a truncated or corrupt file fails here, as one line),
names and shapes — before a single tensor is read. Tensors then come from `safe_open`
one at a time; with safetensors >= 0.7 they are memory-mapped (copy-on-write), so
reading a model costs page cache, not private memory.

Writing lays each safetensors file out from the tensors' specs (names, shapes, dtypes)
before any data arrives and writes every tensor at its offset as it comes, in any
order. When the caller knows all specs up front (a conversion does: its source was
validated), the whole sharding is planned first and the writer holds nothing but the
tensor in hand. Otherwise tensors are gathered one shard at a time (until the next
would pass `max_shard_bytes`), so peak memory is one shard. A model that fits in one
shard is `model.safetensors` without an index, as `save_pretrained` writes it; else
`model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`.

Why our own writer: `safetensors.torch.save_file` needs every tensor of a shard in
memory at once (why: docs/performance.md#memory). The file format is small and public
(8-byte header length, JSON header, raw little-endian bytes); reading always goes through the
safetensors library, and the tests read every written file back with it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ouro_cli.model.config import OuroConfig

from .assets import copy_assets, naming_present_code
from .names import (
    CheckpointError,
    TensorSpec,
    check_tensors,
    expected_shapes,
    strip_wrapper_prefixes,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

OnTensor = Callable[[str, torch.Tensor], None]


def is_hf_dir(path: Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and ((path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file())


# ---- reading ------------------------------------------------------------------------


@dataclass
class _Stored:
    file: Path
    key: str  # the name inside the file (may carry wrapper prefixes)
    spec: TensorSpec


class HFCheckpoint:
    """A validated Hugging Face Ouro directory; tensors are read only when iterated."""

    kind = "hf"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.config = OuroConfig.from_file(self.path / "config.json")
        self.assets_dir = self.path
        stored = _read_headers(self.path)
        expected = expected_shapes(self.config)
        check_tensors(str(self.path), {n: s.spec.shape for n, s in stored.items()}, expected)
        self._stored = {name: stored[name] for name in expected}  # model order

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {name: s.spec for name, s in self._stored.items()}

    @property
    def input_paths(self) -> list[Path]:
        return [self.path]

    def release(self) -> None:
        """Nothing is held between reads of an HF directory (MegatronCheckpoint's pins its iteration)."""

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(physical name, tensor) one at a time, file by file (model order within a file)."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name, s in self._stored.items():
            by_file.setdefault(s.file, []).append(name)
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in names:
                    yield name, f.get_tensor(self._stored[name].key)


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of an HF directory and, when sharded, its weight_map."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a valid index (needs a 'weight_map' object): {err}") from err
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        files = sorted({path / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files, weight_map
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE], None
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.safetensors"))
    hint = f" (found {', '.join(others[:3])}; only {SINGLE_FILE} or a sharded index is read)" if others else ""
    raise CheckpointError(f"{path} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _read_headers(path: Path) -> dict[str, _Stored]:
    """Physical name -> where it is stored and its shape/dtype, from the headers alone."""
    from safetensors import SafetensorError, safe_open

    files, weight_map = _weight_files(path)
    stored: dict[str, _Stored] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    tensor_slice = f.get_slice(key)
                    spec = TensorSpec(tuple(tensor_slice.get_shape()), _dtype(tensor_slice.get_dtype(), file, key))
                    name = strip_wrapper_prefixes(key)
                    if name in stored:
                        raise CheckpointError(
                            f"{path}: tensor {name} is stored twice ({stored[name].file.name} and {file.name})"
                        )
                    stored[name] = _Stored(file, key, spec)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({err}); it is truncated or corrupt: re-download or "
                f"re-convert it"
            ) from err
    if weight_map is not None:
        for key, file_name in weight_map.items():
            name = strip_wrapper_prefixes(key)
            if name not in stored:
                raise CheckpointError(
                    f"{path / INDEX_FILE} lists {key} in {file_name}, but none of the shards it names holds it"
                )
            if stored[name].file.name != file_name:
                raise CheckpointError(
                    f"{path / INDEX_FILE} lists {key} in {file_name}, but it is in {stored[name].file.name}"
                )
    return stored


def _dtype(code: str, file: Path, key: str) -> torch.dtype:
    try:
        return _DTYPES[code]
    except KeyError:
        raise CheckpointError(f"{file}: tensor {key} has unsupported dtype {code}") from None


# ---- writing ------------------------------------------------------------------------

_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class _SafetensorsFile:
    """A safetensors file whose header is written from specs first; each tensor's bytes
    then go to their offset (pwrite), in whatever order tensors arrive.

    Within the file, tensors are ordered by decreasing element size (then as given), as
    `safetensors.save_file` does, so every tensor's data stays aligned for its dtype.
    """

    def __init__(self, path: Path, specs: dict[str, TensorSpec]) -> None:
        self.path, self.specs = path, specs
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        self.offsets: dict[str, int] = {}
        offset = 0
        for name in sorted(specs, key=lambda n: -specs[n].dtype.itemsize):
            spec = specs[name]
            if spec.dtype not in _CODES:
                raise ValueError(f"tensor {name}: dtype {spec.dtype} cannot be stored in safetensors here")
            header[name] = {
                "dtype": _CODES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            self.offsets[name] = offset
            offset += spec.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.data_start = 8 + len(encoded)
        self.missing = set(specs)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self.fd, len(encoded).to_bytes(8, "little") + encoded)
        os.ftruncate(self.fd, self.data_start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs[name]
        if name not in self.missing:
            raise ValueError(f"tensor {name} given twice")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {spec.shape} {spec.dtype}")
        data = memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        position = self.data_start + self.offsets[name]
        while data:
            written = os.pwrite(self.fd, data, position)
            data, position = data[written:], position + written
        self.missing.discard(name)

    def close(self, *, complete: bool = True) -> None:
        os.close(self.fd)
        if complete and self.missing:
            raise ValueError(f"{self.path.name}: never received {', '.join(sorted(self.missing))}")


def plan_shards(specs: dict[str, TensorSpec], max_shard_bytes: int) -> list[dict[str, TensorSpec]]:
    """Greedy in order: a shard takes tensors until the next would pass the limit (a tensor
    larger than the limit gets a shard of its own)."""
    shards: list[dict[str, TensorSpec]] = [{}]
    size = 0
    for name, spec in specs.items():
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = spec
        size += spec.nbytes
    return shards


@dataclass
class WriteSummary:
    tensors: int
    parameters: int
    bytes: int
    files: list[str]
    assets: list[str]


def write_hf(
    out_dir: Path,
    config: OuroConfig,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    assets_from: Path | None = None,
    specs: dict[str, TensorSpec] | None = None,
    on_tensor: OnTensor | None = None,
) -> WriteSummary:
    """Write an HF Ouro directory into the existing `out_dir`: weights, assets, config.json
    (its `auto_map` naming only the remote code among the assets: `naming_present_code`).

    `specs` (every tensor to come, in the order the shards should follow) lets the
    writer plan all shards first and stream each tensor straight to disk; without it,
    tensors are gathered one shard at a time. `on_tensor(name, tensor)` is called as
    each tensor arrives.
    """
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    out_dir = Path(out_dir)
    if specs is not None:
        shards = _write_planned(out_dir, named_tensors, plan_shards(specs, max_shard_bytes), on_tensor)
    else:
        shards = _write_gathered(out_dir, named_tensors, max_shard_bytes, on_tensor)

    if len(shards) == 1:
        files = [SINGLE_FILE]
    else:
        files = [_SHARD_NAME.format(k, len(shards)) for k in range(1, len(shards) + 1)]
        index = {
            "metadata": {"total_size": sum(s.nbytes for shard in shards for s in shard.values())},
            "weight_map": dict(
                sorted((name, file) for file, shard in zip(files, shards, strict=True) for name in shard)
            ),
        }
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for k, final in enumerate(files):
        os.replace(out_dir / _partial_name(k), out_dir / final)
    assets = copy_assets(assets_from, out_dir)
    naming_present_code(config, out_dir).save(out_dir)
    all_specs = [s for shard in shards for s in shard.values()]
    return WriteSummary(
        len(all_specs), sum(s.numel for s in all_specs), sum(s.nbytes for s in all_specs), files, assets
    )


def _partial_name(k: int) -> str:
    return f".shard-{k + 1:05d}.safetensors.partial"  # final names need the shard count


def _write_planned(
    out_dir: Path,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    shards: list[dict[str, TensorSpec]],
    on_tensor: OnTensor | None,
) -> list[dict[str, TensorSpec]]:
    files = [_SafetensorsFile(out_dir / _partial_name(k), shard) for k, shard in enumerate(shards)]
    where = {name: f for f in files for name in f.specs}
    try:
        for name, tensor in named_tensors:
            if name not in where:
                raise ValueError(f"tensor {name} was not planned")
            where[name].write(name, tensor)
            if on_tensor is not None:
                on_tensor(name, tensor)
    except BaseException:
        for f in files:
            f.close(complete=False)
        raise
    for f in files:
        f.close()
    return shards


def _write_gathered(
    out_dir: Path, named_tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int, on_tensor: OnTensor | None
) -> list[dict[str, TensorSpec]]:
    shards: list[dict[str, TensorSpec]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    seen: set[str] = set()  # a file catches repeats only within itself

    def flush() -> None:
        nonlocal pending, pending_bytes
        specs = {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in pending.items()}
        f = _SafetensorsFile(out_dir / _partial_name(len(shards)), specs)
        for name, tensor in pending.items():
            f.write(name, tensor)
        f.close()
        shards.append(specs)
        pending, pending_bytes = {}, 0

    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name} given twice")
        seen.add(name)
        if pending and pending_bytes + tensor.nbytes > max_shard_bytes:
            flush()
        pending[name] = tensor
        pending_bytes += tensor.nbytes
        if on_tensor is not None:
            on_tensor(name, tensor)
    if pending or not shards:
        flush()
    return shards


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`5GB` -> 5e9 bytes, `500MiB` -> 500 * 2**20, `1000` -> 1000 (as `save_pretrained`'s max_shard_size)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a size (examples: 5GB, 500MB, 2GiB, 1000000)")
    number, unit = float(match.group(1)), (match.group(2) or "b").lower()
    if unit == "b":
        factor = 1
    else:
        power = "kmgt".index(unit[0]) + 1
        factor = (1024 if "i" in unit else 1000) ** power
    size = int(number * factor)
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size
