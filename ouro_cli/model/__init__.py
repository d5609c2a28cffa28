"""Ouro in PyTorch. Knows nothing of Megatron or the engine; both use it.

from ouro_cli.model import load
model = load("path/to/hf_or_megatron_checkpoint", dtype=torch.bfloat16, device="cuda")
logits = model(input_ids)                  # full depth
logits = model(input_ids, depths=depths)   # per-position loop counts (docs/model.md §3)

Names resolve on first use (`__getattr__`), so `ouro_cli.model.config` (the config alone,
read by the option tree and the dry run) loads without torch.
"""

from ouro_cli.lazy_names import resolver

_WHERE = {
    "ConfigError": "config",
    "OuroConfig": "config",
    "tiny_config": "config",
    "exit_cdf": "exit_gate",
    "exit_distribution": "exit_gate",
    "fuse_projections": "fusion",
    "build": "loading",
    "from_state_dict": "loading",
    "load": "loading",
    "OuroForCausalLM": "ouro",
}


__getattr__ = resolver(__name__, _WHERE)


__all__ = [
    "ConfigError",
    "OuroConfig",
    "OuroForCausalLM",
    "build",
    "exit_cdf",
    "exit_distribution",
    "from_state_dict",
    "fuse_projections",
    "load",
    "tiny_config",
]
