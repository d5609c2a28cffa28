"""What a checkpoint path means: an HF directory, a Megatron checkpoint, or a run directory.

Every command that reads weights (convert, export, eval, train's `--init`,
`ouro_cli.model.load`) resolves its path here, so the rules exist once:

- a directory with `latest_checkpointed_iteration.txt` is a Megatron checkpoint
  (its latest iteration must carry the COMPLETE marker);
- a directory with `checkpoint/latest_checkpointed_iteration.txt` is a run directory,
  read through that checkpoint (a run without its COMPLETE marker has not finished: its
  latest complete checkpoint is read, and `unfinished_run_note` says so);
- a directory with `config.json` and `model.safetensors` or its index is an HF directory.

Opening validates the whole checkpoint (config, headers, names, shapes) and reads no
weights; `iter_tensors()` then streams them. What a path means (`assets_dir`,
`megatron_root`) is answered without torch: the readers are imported when one opens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ouro_cli.artifacts import real_path
from ouro_cli.errors import UserError
from ouro_cli.model.config import OuroConfig

from . import layout

if TYPE_CHECKING:
    import torch

    from .names import TensorSpec

RUN_CHECKPOINT_DIR = "checkpoint"  # RUN/checkpoint/ holds a training run's Megatron checkpoint


class CheckpointSource(Protocol):
    kind: str
    path: Path
    config: OuroConfig
    assets_dir: Path

    @property
    def specs(self) -> dict[str, TensorSpec]: ...

    @property
    def input_paths(self) -> list[Path]: ...

    def release(self) -> None: ...

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def run_checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / RUN_CHECKPOINT_DIR


def megatron_root(path: Path) -> Path | None:
    """The Megatron checkpoint root that `path` (a checkpoint or a run directory) names, if any."""
    path = Path(path)
    if layout.is_megatron_checkpoint(path):
        return path
    if layout.is_megatron_checkpoint(run_checkpoint_dir(path)):
        return run_checkpoint_dir(path)
    return None


def assets_dir(path: str | Path) -> Path:
    """Where the checkpoint at `path` keeps its config.json and tokenizer: a Megatron checkpoint's
    (or a run directory's) `hf_assets/`, else `path` itself. Nothing is validated or read: what
    needs a model's shapes and not its weights (`ouro train --dry-run`, the `auto` options)
    reads them from here."""
    root = megatron_root(Path(path))
    return Path(path) if root is None else root / layout.HF_ASSETS


def open_checkpoint(path: str | Path) -> CheckpointSource:
    """The validated checkpoint at `path`, or a UserError saying what `path` is missing."""
    path = Path(path)
    if not path.exists():
        real_path(path)  # a symbolic link loop says so
        raise UserError(f"{path} does not exist")
    if not path.is_dir():
        raise UserError(f"{path} is a file; expected a checkpoint directory")
    root = megatron_root(path)
    if root is not None:
        from .megatron import MegatronCheckpoint

        return MegatronCheckpoint(root)
    from .hf import INDEX_FILE, SINGLE_FILE, HFCheckpoint, is_hf_dir

    if is_hf_dir(path) or (path / "config.json").is_file():
        return HFCheckpoint(path)  # a config without weights gets HFCheckpoint's precise message
    from ouro_cli.rl.run_dir import RunDir

    if RunDir(path).is_run():
        raise UserError(
            f"{path} is a run that has not saved a checkpoint yet; read it after its first save "
            "(--save-interval), or continue it with `ouro resume`"
        )
    raise UserError(
        f"{path} is not an Ouro checkpoint: expected an HF directory (config.json + {SINGLE_FILE} "
        f"or {INDEX_FILE}), a Megatron checkpoint ({layout.TRACKER}) or a run directory "
        f"({RUN_CHECKPOINT_DIR}/{layout.TRACKER})"
    )


def unfinished_run_note(path: str | Path, source: CheckpointSource) -> str | None:
    """What a command says when `path` is a run directory that has not finished (no COMPLETE):
    which of its checkpoints `source` (opened from `path`) reads."""
    from ouro_cli.artifacts import is_complete

    path = Path(path)
    if megatron_root(path) != run_checkpoint_dir(path) or is_complete(path):
        return None
    return (
        f"{path} is a run that has not finished (no COMPLETE marker): using its latest complete "
        f"checkpoint, {RUN_CHECKPOINT_DIR}/{Path(source.path).name}"
    )


def read_checkpoint(path: str | Path) -> tuple[OuroConfig, dict[str, torch.Tensor]]:
    """(config, physical name -> tensor) of any checkpoint `open_checkpoint` accepts; dtypes as stored."""
    source = open_checkpoint(path)
    return source.config, dict(source.iter_tensors())
