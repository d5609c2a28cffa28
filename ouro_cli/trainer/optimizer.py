"""Megatron-core optimizer (Adam, clipping, fp32 main weights) and LR scheduler.

`get_megatron_optimizer` picks the implementation from the config: plain fp32 params
get `FP32Optimizer`; bf16 params get fp32 main weights (`Float16OptimizerWithFloat16Params`);
`use_distributed_optimizer` shards main weights and Adam moments over data-parallel
ranks. Gradient clipping (global L2 norm) is the optimizer's own (`clip_grad`), its norm
taken without host waits (mcore/grad_norm.py).

Two facts about these optimizers that checkpointing relies on (see checkpointing.py):
Adam state exists only after the first step, and the distributed optimizer's loading
path restores Adam's `step` as 0, so the step count is saved and restored separately.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ouro_cli.errors import UserError
from ouro_cli.mcore.grad_norm import use_sync_free_grad_norm

from .config import TrainerConfig


def build_optimizer(config: TrainerConfig, ddp_model) -> MegatronOptimizer:
    dtype = config.torch_dtype
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=config.learning_rate,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        clip_grad=config.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=config.use_distributed_optimizer,
    )
    use_sync_free_grad_norm()
    return get_megatron_optimizer(optimizer_config, [ddp_model])


def build_scheduler(config: TrainerConfig, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """Constant LR, or linear warmup then cosine decay to `min_lr` at `decay_steps`.

    Megatron's warmup starts at `init_lr` = 0 and reaches `lr` after `warmup_steps`
    optimizer steps (step k of warmup uses lr * k / warmup_steps, so the very first
    warmup step has LR 0). With no warmup the first step uses the full LR.
    """
    if config.lr_schedule == "cosine" and config.decay_steps is None:
        raise UserError("lr_schedule=cosine needs decay_steps (the steps from the start to min_lr)")
    # Megatron wants decay_steps > warmup_steps even when nothing decays.
    decay_steps = config.decay_steps if config.lr_schedule == "cosine" else config.warmup_steps + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=config.learning_rate,
        min_lr=config.min_lr,
        lr_warmup_steps=config.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=config.lr_schedule,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
    )


def inner_optimizers(optimizer: MegatronOptimizer) -> list:
    """The per-dtype Megatron optimizers inside a ChainedOptimizer (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def torch_optimizers(optimizer: MegatronOptimizer) -> Iterator[torch.optim.Optimizer]:
    for inner in inner_optimizers(optimizer):
        if getattr(inner, "optimizer", None) is not None:
            yield inner.optimizer


def adam_steps(optimizer: MegatronOptimizer) -> list[float | None]:
    """The Adam step count of each inner torch optimizer (None before its first step)."""
    steps = []
    for opt in torch_optimizers(optimizer):
        values = {float(s["step"]) for s in opt.state.values() if "step" in s}
        if len(values) > 1:
            raise RuntimeError(f"inconsistent Adam step counts {sorted(values)}")
        steps.append(values.pop() if values else None)
    return steps


def set_adam_steps(optimizer: MegatronOptimizer, steps: list[float | None]) -> None:
    """Give every parameter its own `step` tensor holding the saved count.

    Own tensors matter: torch's Adam increments each state's step in place, and the
    distributed optimizer's loader hands all parameters one shared tensor.
    """
    opts = list(torch_optimizers(optimizer))
    if len(opts) != len(steps):
        raise RuntimeError(f"checkpoint has {len(steps)} optimizer step counts, this optimizer {len(opts)}")
    for opt, step in zip(opts, steps, strict=True):
        for state in opt.state.values():
            if step is None:  # saved before any step: back to torch's lazily created state
                state.clear()
            else:
                state["step"] = torch.tensor(float(step), dtype=torch.float32)


def init_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """Allocate Adam state (zero moments, step 0) where none exists yet.

    Loading needs it (the state dict to fill must exist), and so does saving the
    distributed optimizer before its first step. Adam treats this state exactly like
    the state it creates lazily at its first step.
    """
    for inner in inner_optimizers(optimizer):
        if getattr(inner, "optimizer", None) is None:
            continue
        if inner.init_state_fn is not None:
            inner.init_state_fn(inner.optimizer, inner.config)
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                inner.optimizer.state[p].setdefault("step", torch.tensor(0.0))


class OptimizerOffload:
    """`--offload-optimizer`: the optimizer's own tensors (fp32 main weights where they are
    separate from the model's parameters, and Adam's moments) live in host memory except
    during `optimizer.step()`, which runs on the device as before.

    Tensors are moved by rebinding their `.data`, so every holder (Megatron's main-param
    groups, the torch optimizer's param groups and its state, keyed by tensor identity) keeps
    seeing the same object; values are copied exactly, so training is bit-identical with and
    without offload. Host copies are pinned on CUDA (page-locked copies run at full PCIe
    speed) and kept between steps. A checkpoint is saved from and loaded into wherever the
    tensors are. Where the device is the host (CPU), the moves are plain copies.
    """

    def __init__(
        self, optimizer: MegatronOptimizer, model_params: Iterator[torch.Tensor], device: torch.device
    ) -> None:
        self.optimizer, self.device = optimizer, device
        self._model = {id(p) for p in model_params}
        self._host: dict[int, torch.Tensor] = {}
        self.on_host = False
        # the job's choice (rl/sizing.py state_per_call): the state stays on the device after a
        # step, and the job moves it out (`to_host`) only before the calls that need its room
        self.keep_after_step = False

    def _tensors(self) -> Iterator[torch.Tensor]:
        for opt in torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in self._model:  # fp32 main weights; fp32 params are their own
                        yield p
            for state in opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:  # moments, not the step count
                        yield value

    def to_host(self) -> None:
        for t in self._tensors():  # tensors already there are skipped (loading may have made new ones)
            host = self._host.get(id(t))
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.device.type == "cuda")
                self._host[id(t)] = host
            if host.data_ptr() != t.data_ptr():
                host.copy_(t.data, non_blocking=True)
                t.data = host
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the device copies may be freed only once copied
        self.on_host = True

    def to_device(self) -> None:
        for t in self._tensors():
            if t.device != self.device:
                t.data = t.data.to(self.device, non_blocking=True)
        self.on_host = False
