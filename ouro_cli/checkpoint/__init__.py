"""Every on-disk format of Ouro weights, and the one naming they share.

- `names`: the physical HF tensor names and shapes for a config, wrapper-prefix
  stripping, and the missing / unexpected / mis-shaped check (`CheckpointError`).
- `hf`: Hugging Face directories (lazy, validated reading; size-sharded streaming writing).
- `megatron`: Megatron-core dist checkpoints keyed by physical name.
- `layout`: their directory structure and what makes an iteration valid (COMPLETE marker).
- `assets`: tokenizer, generation config and remote-code files that travel along.
- `sources`: what a path means (HF dir, Megatron checkpoint, run dir) and `read_checkpoint`.
- `convert`: whole conversions written as complete, manifested artifacts.

Names resolve on first use (`__getattr__`): importing this package, or `layout` alone (what
`ouro status` reads), imports neither torch nor megatron-core; only Megatron writes import
megatron-core.
"""

from ouro_cli.lazy_names import resolver

_WHERE = {
    "DEFAULT_MAX_SHARD_BYTES": "hf",
    "HFCheckpoint": "hf",
    "parse_size": "hf",
    "write_hf": "hf",
    "CheckpointError": "names",
    "TensorSpec": "names",
    "check_tensors": "names",
    "expected_shapes": "names",
    "strip_wrapper_prefixes": "names",
    "CheckpointSource": "sources",
    "open_checkpoint": "sources",
    "read_checkpoint": "sources",
    "run_checkpoint_dir": "sources",
}


__getattr__ = resolver(__name__, _WHERE)


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
