"""Building and loading Ouro modules: random init for tests, or any checkpoint on disk."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import OuroConfig
from .meta_init import on_meta
from .ouro import OuroForCausalLM


def build(
    config: OuroConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int | None = 0,
    std: float = 0.02,
) -> OuroForCausalLM:
    """A randomly initialised model (normal(0, std) matrices, norms near one).

    Norm weights are jittered around one so that tests notice a norm applied in the
    wrong place; the gate bias is drawn too so exits are not all alike.
    """
    generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    model = OuroForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            elif name.endswith("early_exit_gate.bias"):
                p.copy_(torch.randn(p.shape, generator=generator))
            else:
                p.copy_(std * torch.randn(p.shape, generator=generator))
    return model.to(device=device, dtype=dtype)


def load(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> OuroForCausalLM:
    """The model stored at `path`: a Hugging Face directory, a Megatron checkpoint
    directory (with `latest_checkpointed_iteration.txt`), or a run directory.

    dtype None keeps the stored dtype. Tensors are materialised once, directly on
    `device` where possible (the module is built on the meta device first).
    """
    from ouro_cli.checkpoint import read_checkpoint  # checkpoint/ owns every on-disk format

    config, tensors = read_checkpoint(path)
    return from_state_dict(config, tensors, dtype=dtype, device=device)


def from_state_dict(
    config: OuroConfig,
    tensors: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> OuroForCausalLM:
    with on_meta():
        model = OuroForCausalLM(config)
    state = {k: v.to(device=device, dtype=dtype or v.dtype) for k, v in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model
