"""The Ouro model as a Megatron module, under its physical Hugging Face parameter names.

`OuroMegatronModule` adopts the `model` and `lm_head` children of an `OuroForCausalLM`
as its own, so `named_parameters()` and the dist-checkpoint keys are exactly the HF
names (`model.layers.0.self_attn.q_proj.weight`, ..., `lm_head.weight`): checkpoints,
conversion and weight publication share one naming and no mapping table exists. The
forward pass is the model's own (`OuroForCausalLM.forward`, depth replay included);
nothing is re-implemented here.

The exit gate `model.early_exit_gate.*` is frozen for GRPO: requires_grad is off before
DDP and the optimizer see the parameters, so it gets no grad buffer and no optimizer
state, yet it stays in the state dict (saved, loaded, published).
"""

from __future__ import annotations

import warnings

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from ouro_cli.model import OuroConfig, OuroForCausalLM

FROZEN_PREFIXES = ("model.early_exit_gate.",)


def transformer_config(config: OuroConfig, params_dtype: torch.dtype) -> TransformerConfig:
    """The Megatron view of the model's shape and precision (read by DDP and the optimizer).

    `calculate_per_token_loss=True` makes DDP sum gradients across ranks instead of
    averaging them: the GRPO loss is already normalised by the global token (or
    sequence) count, so a sum is the exact gradient of the global-batch loss.
    """
    with warnings.catch_warnings():  # deprecation noise about CUDA-graph options we do not use
        warnings.simplefilter("ignore", UserWarning)
        return TransformerConfig(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_key_value_heads,
            kv_channels=config.dim_per_head,
            params_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            use_cpu_initialization=True,
            calculate_per_token_loss=True,
        )


class OuroMegatronModule(MegatronModule):
    """A MegatronModule whose children are the HF model's `model` and `lm_head`."""

    def __init__(self, model: OuroForCausalLM, config: TransformerConfig) -> None:
        super().__init__(config)
        self.model = model.model
        self.lm_head = model.lm_head
        # The wrapped OuroForCausalLM is kept outside the module tree: registering it would
        # add a second name ("ouro.model...") for every parameter.
        object.__setattr__(self, "ouro", model)
        for name, param in self.named_parameters():
            if name.startswith(FROZEN_PREFIXES):
                param.requires_grad_(False)

    @property
    def ouro_config(self) -> OuroConfig:
        return self.ouro.config

    def forward(self, input_ids: torch.Tensor, depths: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.ouro(input_ids, depths, **kwargs)


def wrap_ddp(
    module: OuroMegatronModule, *, use_distributed_optimizer: bool, overlap_grad_reduce: bool
) -> DistributedDataParallel:
    """Megatron DDP with fp32 gradient buffers (bf16 params accumulate grads in fp32)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return DistributedDataParallel(module.config, ddp_config, module)
