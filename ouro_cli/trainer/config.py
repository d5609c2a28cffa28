"""`TrainerConfig`: every option of the Megatron-core GRPO trainer, typed, defaulted and
validated in one place (the CLI maps its flags onto these fields).

Defaults follow docs/architecture.md §3: clipped policy gradient with ε_low 0.2 / ε_high 0.28,
token-mean aggregation, Adam, gradient clipping at 1.0, constant LR. The parameter
dtype defaults to bf16 on CUDA (fp32 main weights in the optimizer) and fp32 on CPU,
where bf16 buys nothing and exactness tests need fp32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from ouro_cli.errors import UserError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class TrainerConfig:
    # ---- where and how it runs --------------------------------------------------
    device: Literal["auto", "cpu", "cuda"] = "auto"
    params_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    seed: int = 1234
    deterministic: bool = True  # CUDA: deterministic kernels in forward/backward (determinism.py)

    # ---- GRPO loss ----------------------------------------------------------------
    eps_low: float = 0.2
    eps_high: float = 0.28
    aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"

    # ---- micro-batching -----------------------------------------------------------
    micro_batch_size: int | None = None  # at most this many samples per micro-batch; None: no count limit
    max_tokens_per_micro_batch: int | None = None  # at most this many positions (padding included); None: no limit
    pack: bool = True  # several samples per row (document masking) instead of one padded row each
    pack_length: int | None = None  # max tokens per packed row; None: the longest local sample
    recompute: bool = False  # re-run each layer call in backward instead of keeping activations

    # ---- optimizer and schedule ---------------------------------------------------
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None  # cosine: steps from the start to min_lr (incl. warmup)
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    offload_optimizer: bool = False  # main weights and Adam moments in host memory between steps

    # ---- checkpoints --------------------------------------------------------------
    keep_last: int | None = None  # keep the newest N iterations; None keeps all
    async_save: bool = False  # write checkpoints in the background (Trainer.save, checkpointing.py)

    extra: dict[str, Any] = field(default_factory=dict)  # recorded, not interpreted

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise UserError(message)

        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
            value = getattr(self, name)
            need(value == 1, f"{name}={value} is not supported yet: the trainer is data parallel only "
                 "(TP = PP = CP = 1); scale out with more data-parallel ranks")
        need(self.device in ("auto", "cpu", "cuda"), f"device {self.device!r}: use auto, cpu or cuda")
        need(self.params_dtype in ("auto", *_DTYPES), f"params_dtype {self.params_dtype!r}: use auto, fp32 or bf16")
        need(self.resolved_device != "cuda" or torch.cuda.is_available(), "device=cuda but no CUDA device is visible")
        need(self.eps_low >= 0 and self.eps_high >= 0, "eps_low and eps_high must be >= 0")
        need(self.eps_low < 1, "eps_low must be < 1 (the ratio is clipped at 1 - eps_low)")
        need(self.aggregation in ("token_mean", "sequence_mean"), f"aggregation {self.aggregation!r}: use token_mean or sequence_mean")
        need(self.micro_batch_size is None or self.micro_batch_size >= 1, "micro_batch_size must be >= 1")
        need(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 2,
             "max_tokens_per_micro_batch must be >= 2")
        need(self.pack_length is None or self.pack_length >= 2, "pack_length must be >= 2 tokens")
        need(self.lr > 0, "lr must be > 0")
        need(0 <= self.min_lr <= self.lr, "min_lr must lie in [0, lr]")
        need(self.lr_schedule in ("constant", "cosine"), f"lr_schedule {self.lr_schedule!r}: use constant or cosine")
        need(self.warmup_steps >= 0, "warmup_steps must be >= 0")
        if self.lr_schedule == "cosine":
            need(self.decay_steps is not None and self.decay_steps > self.warmup_steps,
                 "lr_schedule=cosine needs decay_steps > warmup_steps")
        need(self.weight_decay >= 0, "weight_decay must be >= 0")
        need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "adam betas must lie in [0, 1)")
        need(self.clip_grad >= 0, "clip_grad must be >= 0 (0 disables clipping)")
        need(self.keep_last is None or self.keep_last >= 1, "keep_last must be >= 1")

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.params_dtype == "auto":
            return torch.bfloat16 if self.resolved_device == "cuda" else torch.float32
        return _DTYPES[self.params_dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
