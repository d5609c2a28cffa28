"""Every on-disk format of Ouro weights, and the one naming they share.

- `names`: the physical HF tensor names and shapes for a config, wrapper-prefix
  stripping, and the missing / unexpected / mis-shaped check (`CheckpointError`).
- `hf`: Hugging Face directories (lazy, validated reading; size-sharded streaming writing).
- `megatron`: Megatron-core dist checkpoints keyed by physical name.
- `layout`: their directory structure and what makes an iteration valid (COMPLETE marker).
- `assets`: tokenizer, generation config and remote-code files that travel along.
- `sources`: what a path means (HF dir, Megatron checkpoint, run dir) and `read_checkpoint`.
- `convert`: whole conversions written as complete, manifested artifacts.

Importing this package does not import megatron-core; only Megatron reads and writes do.
"""

from .hf import DEFAULT_MAX_SHARD_BYTES, HFCheckpoint, parse_size, write_hf
from .names import (
    CheckpointError,
    TensorSpec,
    check_tensors,
    expected_shapes,
    strip_wrapper_prefixes,
)
from .sources import CheckpointSource, open_checkpoint, read_checkpoint, run_checkpoint_dir

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "CheckpointError",
    "CheckpointSource",
    "HFCheckpoint",
    "TensorSpec",
    "check_tensors",
    "expected_shapes",
    "open_checkpoint",
    "parse_size",
    "read_checkpoint",
    "run_checkpoint_dir",
    "strip_wrapper_prefixes",
    "write_hf",
]
