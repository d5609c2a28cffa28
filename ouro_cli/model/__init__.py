"""Ouro in PyTorch. Knows nothing of Megatron or the engine; both use it.

from ouro_cli.model import load
model = load("path/to/hf_or_megatron_checkpoint", dtype=torch.bfloat16, device="cuda")
logits = model(input_ids)                  # full depth
logits = model(input_ids, depths=depths)   # per-position loop counts (docs/model.md §3)
"""

from .config import ConfigError, OuroConfig, tiny_config
from .exit_gate import exit_cdf, exit_distribution
from .fusion import fuse_projections
from .loading import build, from_state_dict, load
from .ouro import OuroForCausalLM

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
