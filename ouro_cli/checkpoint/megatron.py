"""Megatron-core dist checkpoints of Ouro weights: save converted weights, load any iteration.

Each model tensor is one `ShardedTensor` whose key is its physical Hugging Face name
(`model.layers.0.mlp.up_proj.weight`, ...). The trainer saves its model under the same
keys, next to optimizer, scheduler and RNG state; loading asks only for the model
names and ignores everything else, so a converted checkpoint and a training iteration
read the same way. Dtypes come from the checkpoint's own metadata (its `.metadata`
file) and tensors are loaded into empty tensors of that dtype: nothing is cast, so a
round trip is bit-exact.

Megatron's `torch_dist` backend stores a checkpoint in PyTorch's distributed-checkpoint
format (`.metadata` and `__R_T.distcp` files beside megatron's `metadata.json`), so reading
needs only `torch.distributed.checkpoint`, within this process and without a process group:
commands that read weights (export, eval, convert mcore-to-hf) never import megatron-core,
whose import is slow. Saving goes through megatron-core, imported only then.

Directory layout and the validity rule (COMPLETE marker, tracker written last) are
`layout.py`'s; the HF config, tokenizer and remote code for a later export go to
`CKPT/hf_assets/`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from ouro_cli.model.config import OuroConfig

from . import layout
from .assets import copy_assets
from .names import (
    CheckpointError,
    TensorSpec,
    check_tensors,
    expected_shapes,
    strip_wrapper_prefixes,
)

DEFAULT_LOAD_BATCH_BYTES = 256 * 2**20
BACKEND = "torch_dist"  # the megatron backend whose files are torch DCP's (metadata.json names it)


def _dist_checkpointing():
    from ouro_cli.mcore.importing import import_megatron_core

    with warnings.catch_warnings():  # import-time notices about Apex/TE and deprecated modules
        warnings.simplefilter("ignore")
        import_megatron_core()
        from megatron.core import dist_checkpointing
    return dist_checkpointing


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a failed read raises: torch DCP's CheckpointException is a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def read_dist_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the dist checkpoint iteration at `path` as stored (model, optimizer
    state), by checkpoint key, at its global shape and stored dtype."""
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in _tensor_metadata(Path(path)).items()}
    _load_into(Path(path), tensors)
    return tensors


def _tensor_metadata(path: Path) -> dict:
    """Checkpoint key -> torch DCP `TensorStorageMetadata` (global shape, dtype) for every tensor
    of the dist checkpoint at `path`; sharded objects (RNG state) are left out."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    backend = json.loads((path / "metadata.json").read_text()).get("sharded_backend")
    if backend != BACKEND:
        raise CheckpointError(f"its backend is {backend!r}; ouro reads {BACKEND!r} checkpoints")
    metadata = FileSystemReader(str(path)).read_metadata()
    return {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}


def _load_into(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill `tensors` (checkpoint key -> empty tensor of the stored shape and dtype) from the dist
    checkpoint at `path`, in this process alone: every rank that reads does so on its own."""
    from torch.distributed.checkpoint import FileSystemReader, load

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist, as asked
        load(tensors, storage_reader=FileSystemReader(str(path)), no_dist=True)


def sharded_model_state(tensors: dict[str, torch.Tensor]) -> dict:
    """The sharded state dict of whole (unpartitioned) model tensors, keyed by physical name."""
    from megatron.core.dist_checkpointing import ShardedTensor

    return {name: ShardedTensor.from_rank_offsets(name, t, replica_id=0) for name, t in tensors.items()}


def save_megatron(
    root: Path,
    config: OuroConfig,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    iteration: int | str = layout.RELEASE,
    assets_from: Path | None = None,
    on_tensor: Callable[[str, torch.Tensor], None] | None = None,
) -> Path:
    """Save Ouro weights as Megatron iteration `iteration` of `root`; returns the iteration dir.

    The tensors must be gathered before megatron writes them (one dist-checkpoint save),
    so peak memory is one model copy — page cache rather than private memory when they
    are memory-mapped from safetensors files, as `HFCheckpoint` yields them.
    """
    from ouro_cli.mcore import megatron_on_cpu, single_process_group
    from ouro_cli.mcore.sync_save import in_process_results

    root = Path(root)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        tensors[name] = tensor.detach().contiguous()
        if on_tensor is not None:
            on_tensor(name, tensor)
    check_tensors("weights to save", {n: tuple(t.shape) for n, t in tensors.items()}, expected_shapes(config))
    dist_checkpointing = _dist_checkpointing()
    staging = layout.staging_dir(root, iteration)
    with single_process_group(), megatron_on_cpu(), in_process_results():
        dist_checkpointing.save(sharded_model_state(tensors), str(staging))
    del tensors
    write_hf_assets(root, config, assets_from)
    return layout.commit_iteration(root, iteration)


def write_hf_assets(root: Path, config: OuroConfig, assets_from: Path | None) -> Path:
    """CKPT/hf_assets/: config.json and the tokenizer / remote-code files, for export."""
    assets = Path(root) / layout.HF_ASSETS
    assets.mkdir(parents=True, exist_ok=True)
    copy_assets(assets_from, assets)
    config.save(assets)
    return assets


class MegatronCheckpoint:
    """The latest complete iteration of a Megatron checkpoint, validated; tensors load lazily.

    The iteration is pinned for as long as this object lives (`layout.pin_latest`), so a
    training run that writes the checkpoint meanwhile cannot prune it under the reader."""

    kind = "megatron"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path, self._pin = layout.pin_latest(self.root)  # refuses an iteration without COMPLETE
        self.assets_dir = self.root / layout.HF_ASSETS
        if not (self.assets_dir / "config.json").is_file():
            raise CheckpointError(
                f"{self.root} has no {layout.HF_ASSETS}/config.json, so its model configuration is unknown; "
                "convert from the original HF directory with `ouro convert hf-to-mcore`"
            )
        self.config = OuroConfig.from_file(self.assets_dir / "config.json")
        expected = expected_shapes(self.config)
        stored = self._stored_model_tensors(expected)
        check_tensors(
            str(self.path), {n: spec.shape for n, (_, spec) in stored.items()}, expected, allow_unexpected=True
        )
        self._stored = {name: stored[name] for name in expected}

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {name: spec for name, (_, spec) in self._stored.items()}

    @property
    def input_paths(self) -> list[Path]:
        tracker = self.root / layout.TRACKER  # absent after a first save interrupted before its tracker write
        return [*([tracker] if tracker.is_file() else []), self.path, self.assets_dir]

    def release(self) -> None:
        """Unpin the iteration (a reader that has its tensors lets the run prune it)."""
        if self._pin is not None:
            self._pin.release()

    def _stored_model_tensors(self, expected: dict) -> dict[str, tuple[str, TensorSpec]]:
        """Physical name -> (checkpoint key, spec) for the model tensors; other keys are ignored."""
        try:
            metadata = _tensor_metadata(self.path)
        except _read_errors() as err:  # a missing or damaged metadata file, another backend
            raise CheckpointError(f"{self.path} is not a readable Megatron dist checkpoint: {_brief(err)}") from err
        stored: dict[str, tuple[str, TensorSpec]] = {}
        for key, meta in metadata.items():
            name = strip_wrapper_prefixes(key)
            if name in expected:
                if name in stored:
                    raise CheckpointError(f"{self.path}: tensor {name} is stored twice ({stored[name][0]} and {key})")
                stored[name] = (key, TensorSpec(tuple(meta.size), meta.properties.dtype))
        return stored

    def iter_tensors(self, max_batch_bytes: int = DEFAULT_LOAD_BATCH_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
        """(physical name, tensor) in model order, loaded in batches of about `max_batch_bytes`.

        A yielded tensor is no longer referenced here, so a consumer that writes and drops
        tensors keeps only one batch in memory on top of its own buffers.
        """
        for batch in _batches(self._stored, max_batch_bytes):
            loaded = {key: torch.empty(spec.shape, dtype=spec.dtype) for key, spec in batch.values()}
            try:
                _load_into(self.path, loaded)
            except _read_errors() as err:  # a damaged data file surfaces only when read
                raise CheckpointError(
                    f"{self.path} is damaged: reading {next(iter(batch))} and others failed: {_brief(err)}"
                ) from err
            for name, (key, _) in batch.items():
                yield name, loaded.pop(key)


def _brief(err: BaseException) -> str:
    """One line for a user: megatron and torch DCP errors can carry whole remote tracebacks."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _batches(stored: dict[str, tuple[str, TensorSpec]], max_bytes: int) -> Iterator[dict[str, tuple[str, TensorSpec]]]:
    batch: dict[str, tuple[str, TensorSpec]] = {}
    size = 0
    for name, entry in stored.items():
        if batch and size + entry[1].nbytes > max_bytes:
            yield batch
            batch, size = {}, 0
        batch[name] = entry
        size += entry[1].nbytes
    if batch:
        yield batch
