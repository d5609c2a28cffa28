"""`Trainer`: the API the training loop calls.

    trainer = Trainer("path/to/hf_or_mcore", TrainerConfig(lr=1e-6, max_tokens_per_micro_batch=16384))
    metrics = trainer.train_step(samples)        # this rank's samples of the global batch
    metrics = trainer.train_update([mb0, mb1], epochs=2)   # several steps on one batch
    trainer.save(run / "checkpoint", update, extra={"cursor": ...})
    extra = trainer.load(run / "checkpoint")
    publish(engine, trainer.named_weights_for_publication(), version)  # ouro_cli.rl.publish
    trainer.close()

Under `torchrun` every rank builds a Trainer with the same config and model and passes
its own share of the global batch; gradients are summed by Megatron DDP with the loss
normalised over the global batch, so any split over ranks gives the same update.
Megatron code runs inside `megatron_context` (the CPU compatibility layer on a CPU
trainer, nothing on CUDA); the model's forward and backward run outside it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ouro_cli.model import OuroForCausalLM
from ouro_cli.model.ouro import gathering_allowed
from ouro_cli.settings import ExecutionSettings, chosen_settings, executing

from . import checkpointing, setup
from .batching import (
    PlannedMicroBatches,
    Sample,
    TokenCost,
    loss_weights,
    plan_micro_batches,
    split_prompts,
)
from .config import TrainerConfig
from .step import StepProgress, Stopwatch, combine_steps, forward_backward, optimizer_step, replay_logprobs

# runs a step's forward/backward attempt, perhaps again (Trainer.forward_backward); with the step's index
Retry = Callable[[Callable[[], dict[str, float]]], dict[str, float]]
StepRetry = Callable[[int, Callable[[], dict[str, float]]], dict[str, float]]


class Trainer:
    """GRPO on one Ouro model. A given `OuroForCausalLM` is adopted, not copied: it is moved
    to the trainer's device and dtype and its parameters are the ones trained. `execution`
    (ouro_cli/settings.py) becomes the model's execution settings: how its replay computes
    (None: keep a given model's, the defaults for a loaded one); `exact` turns exact mode
    (docs/exact.md) on or off in them, the Python spelling of `ouro train --exact`."""

    def __init__(
        self,
        model: OuroForCausalLM | str | Path,
        config: TrainerConfig | None = None,
        *,
        execution: ExecutionSettings | None = None,
        exact: bool | None = None,
    ) -> None:
        self.config = config or TrainerConfig()
        self.context = setup.initialize(self.config)
        self.device = self.context.device
        dtype = self.config.torch_dtype
        if isinstance(model, OuroForCausalLM):
            hf = model.to(device=self.device, dtype=dtype)
        else:
            from ouro_cli.model import load

            hf = load(model, dtype=dtype, device=self.device)
        hf.execution = chosen_settings(hf.execution, execution, exact)
        self.execution = hf.execution  # the loss's log-softmax runs under it too (pointwise.log_softmax)
        self.num_loops = hf.config.num_loops
        self.num_layers = hf.config.num_hidden_layers
        self.pad_id = hf.config.pad_token_id or 0

        from .megatron_model import OuroMegatronModule, transformer_config, wrap_ddp
        from .optimizer import OptimizerOffload, build_optimizer, build_scheduler

        with self.megatron_context():
            self.module = OuroMegatronModule(hf, transformer_config(hf.config, dtype))
            self.ddp = wrap_ddp(
                self.module,
                use_distributed_optimizer=self.config.use_distributed_optimizer,
                overlap_grad_reduce=self.config.overlap_grad_reduce,
            )
            # Every rank built or loaded the same weights; broadcasting rank 0's makes that a
            # guarantee (one copy of the model over the network, once).
            if self.context.world_size > 1:
                self.ddp.broadcast_params()
            self.optimizer = build_optimizer(self.config, self.ddp)
            self.scheduler = build_scheduler(self.config, self.optimizer)
        self.offload = (
            OptimizerOffload(self.optimizer, self.module.parameters(), self.device) if self.config.offloads else None
        )
        if self.offload is not None:
            self.offload.to_host()
        self.gradients_released = False  # release_gradients(): the grad buffer holds no memory
        self.loaded_iteration: int | None = None  # set by load()
        self._pending_save: tuple[checkpointing.PendingSave, Callable[[Path], None] | None] | None = None
        self.step_progress = StepProgress()  # where train_update stands, for a display (step.StepProgress)

    # ---- one GRPO update ------------------------------------------------------------

    def train_step(
        self, samples: Sequence[Sample], *, retry: Retry | None = None, prepare: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """Forward/backward over this rank's samples, sync, clip, Adam, LR schedule (`retry`,
        `prepare`: `forward_backward`'s)."""
        metrics = self.forward_backward(samples, retry=retry, prepare=prepare)
        metrics.update(self.optimizer_step())
        return metrics

    def train_update(
        self, mini_batches: Sequence[Sequence[Sample]], epochs: int = 1, *, retry: StepRetry | None = None
    ) -> dict[str, Any]:
        """Several optimizer steps on one rollout batch: one `train_step` per mini-batch (this
        rank's share of it; every rank passes the same number), in order, `epochs` times over.

        Every step's ratio is taken against the policy that sampled, so from the second step on
        the clip bounds how far the policy moves from it: against the rollout's logprobs, or
        under `--is-correction` against the trainer's own at the update's first weights, which
        `with_first_logprobs` computes for every sample as the first step starts (is_correction.py;
        an update of one step has them in that step's own forward). A mini-batch that
        holds no response token on any rank takes no step, but the LR schedule still advances
        by one: the schedule counts the planned steps (updates × mini-batches × epochs), so its
        position depends on the update alone. A step the optimizer refuses (a non-finite
        gradient) ends the update there; the caller stops the run (rl/loop.py check_step).

        `retry(index, attempt)` runs each step's forward and backward passes (`forward_backward`),
        `index` counting the update's mini-batches over its epochs, empty ones included; it may
        run them again at a lower micro-batch limit (rl/recovery.py). The first policy's logprobs
        are computed at the start of every attempt of the first step, before the policy moves,
        so a retried first step computes them at its own micro-batches, as its forward does.
        Returns the steps' metrics combined (step.combine_steps)."""
        taken = [self._global_counts(batch, allow_empty=True)[0] > 0 for batch in mini_batches]
        batches = [list(batch) for batch in mini_batches]  # the first policy's logprobs are filled in here
        first_step = taken.index(True) if self.config.is_correction != "none" and epochs * sum(taken) > 1 else None

        def fill_first_logprobs() -> None:
            for batch, any_tokens in zip(batches, taken, strict=True):
                if any_tokens:
                    batch[:] = self.with_first_logprobs(batch)

        steps: list[dict[str, Any] | None] = []
        self.step_progress.steps = epochs * len(batches)
        for index, (epoch, j) in enumerate(itertools.product(range(epochs), range(len(batches)))):
            self.step_progress.step = index + 1
            if not taken[j]:
                with self.megatron_context():
                    self.scheduler.step(increment=1)
                steps.append(None)
                continue
            metrics = self.train_step(
                batches[j],
                retry=functools.partial(retry, index) if retry else None,
                prepare=fill_first_logprobs if index == first_step else None,
            )
            metrics["epoch"] = epoch
            steps.append(metrics)
            if not (metrics["step_applied"] and math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
                return combine_steps(steps)
        return combine_steps(steps)

    def with_first_logprobs(self, samples: Sequence[Sample]) -> list[Sample]:
        """`samples` (this rank's share of one mini-batch) with `first_logprobs`: each response
        token's logprob at the current weights, from the forward a train step on them would run
        (the same micro-batches, step.replay_logprobs), so a step taken now would compute the
        very same values. No gradient is kept and no RNG is drawn."""
        for s in samples:
            s.check(self.num_loops)
        # The plan routes each token's value as it routes its loss weight (split_prompts,
        # build_micro_batch): a token's index in `samples`, passed as its weight, comes back
        # beside its logprob (exact in the micro-batch's fp32 weights below 2**24 tokens).
        offsets = [0]
        for s in samples:
            offsets.append(offsets[-1] + len(s.response_ids))
        if offsets[-1] >= 2**24:
            raise ValueError(f"{offsets[-1]} response tokens in one mini-batch of one rank; at most 2**24 - 1")
        positions = [[float(i) for i in range(a, b)] for a, b in itertools.pairwise(offsets)]
        self.ddp.train()
        with executing(self.execution):
            parts = replay_logprobs(
                self.ddp, self._micro_batches(samples, positions), self.config, self.device, self.num_loops
            )
        flat = torch.empty(offsets[-1], dtype=torch.float32, device=self.device)
        for logprobs, index in parts:
            flat[index.long()] = logprobs
        values = flat.tolist()
        return [
            dataclasses.replace(s, first_logprobs=values[a:b])
            for s, (a, b) in zip(samples, itertools.pairwise(offsets), strict=True)
        ]

    def forward_backward(
        self, samples: Sequence[Sample], *, retry: Retry | None = None, prepare: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """Gradients of the global-batch GRPO loss, synced over ranks, in the grad buffers.

        The rank's own part of the step (the micro-batches cut at `micro_batch_tokens`, their
        forward and backward passes; no collective until the statistics are reduced) is one
        attempt, run by `retry(attempt)`, which may run it again after `discard_step` and a
        lower `limit_micro_batch_tokens` (rl/recovery.py): the ranks' collectives still pair
        up. `prepare()` runs at the start of every attempt, before the micro-batches are cut
        (it may replace the items of the list `samples`)."""
        watch = Stopwatch()
        for s in samples:
            s.check(self.num_loops)
        with self.megatron_context():
            if self.gradients_released:
                self.ddp.restore_grad_buffers(synchronize=False)  # allocated again, zeroed
                self.gradients_released = False
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        global_tokens, global_samples = self._global_counts(samples)
        weights = loss_weights(
            samples, self.config.resolved_aggregation, global_tokens, global_samples, self.config.aggregation_length
        )
        # what the depths require and the real tokens, of the samples as given (their parts
        # repeat the prompt of a split sample)
        whole = {
            "layer_tokens_required": self.num_layers * sum(s.depth_sum(self.num_loops) for s in samples),
            "tokens": sum(s.length for s in samples),
        }
        self.ddp.train()

        def attempt() -> dict[str, float]:
            if prepare is not None:
                prepare()
            with executing(self.execution):
                return forward_backward(
                    self.ddp,
                    self._micro_batches(samples, weights),
                    self.config,
                    self.device,
                    self.num_layers,
                    self.num_loops,
                    model=self.module.ouro,
                    whole=whole,
                    progress=self.step_progress,
                )

        metrics = retry(attempt) if retry is not None else attempt()
        metrics["forward_backward_s"] = watch.lap()
        with self.megatron_context():
            self.ddp.finish_grad_sync()
        metrics["grad_sync_s"] = watch.lap()
        return metrics

    def _micro_batches(self, samples: Sequence[Sample], weights: list[list[float]]) -> PlannedMicroBatches:
        """The forward/backward passes of `samples` (their tokens' loss `weights`): fixed-budget
        samples as prompt heads and bodies where the config asks (batching.split_prompts; not
        under geo-mask, which needs a sequence's tokens together), cut by the token budget
        (batching.plan_micro_batches), each built on the host as the step reaches it."""
        c = self.config
        if c.prompt_heads and c.is_correction != "geo-mask":
            samples, weights = split_prompts(
                samples, weights, self.num_loops, c.prompt_head_overhead, deep_first=c.deep_parts_first
            )
        plan = plan_micro_batches(
            samples,
            micro_batch_size=c.micro_batch_size,
            max_tokens=c.max_tokens_per_micro_batch,
            pack=c.pack,
            pack_length=c.pack_length,
            cost=TokenCost(**c.micro_batch_token_cost) if c.micro_batch_token_cost else None,
            num_loops=self.num_loops,
            gathers=gathering_allowed(self.execution, self.device.type),
        )
        return PlannedMicroBatches(samples, weights, self.num_loops, plan, pad_id=self.pad_id)

    @property
    def micro_batch_tokens(self) -> int | None:
        """The token limit each micro-batch is cut at (None: no limit)."""
        return self.config.max_tokens_per_micro_batch

    def limit_micro_batch_tokens(self, tokens: int | None) -> None:
        """Cut the micro-batches of every later step at `tokens` (batching.plan_micro_batches)."""
        self.config = dataclasses.replace(self.config, max_tokens_per_micro_batch=tokens)

    def discard_step(self) -> None:
        """Drop what a failed attempt of a step accumulated before it runs again: the gradient
        buffers are zeroed and no parameter keeps a `.grad` that its hook had not yet added, so
        the next attempt sums its gradient from zero. The optimizer steps only after a whole
        forward/backward, so the weights are untouched; the step draws no random numbers."""
        with self.megatron_context():
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        self.module.zero_grad(set_to_none=True)

    def optimizer_step(self) -> dict[str, float]:
        watch = Stopwatch()
        if self.offload is not None:
            self.offload.to_device()
        try:
            with self.megatron_context():
                metrics = optimizer_step(self.optimizer, self.scheduler)
        finally:
            if self.offload is not None and not self.offload.keep_after_step:
                self.offload.to_host()  # Adam created its moments at the first step: they go too
        metrics["optimizer_s"] = watch.lap()
        return metrics

    def release_gradients(self) -> None:
        """Free the fp32 grad buffer (4 bytes per parameter) until the next `forward_backward`,
        which allocates it again, zeroed: between an optimizer step and the next update's
        backward the gradients are dead (each update starts from zero), so a rollout can
        use their memory. Megatron's own offload: the buffer's storage is resized to
        nothing, so every view of it (`main_grad`, the buckets) stays the same object."""
        if self.gradients_released:
            return
        cuda = self.device.type == "cuda"
        with self.megatron_context():
            self.optimizer.zero_grad()  # no main-weight .grad keeps a view of the freed storage in use
            self.ddp.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)
        self.gradients_released = True

    def _global_counts(self, samples: Sequence[Sample], allow_empty: bool = False) -> tuple[int, int]:
        from megatron.core import parallel_state

        counts = torch.tensor(
            [sum(len(s.response_ids) for s in samples), len(samples)], dtype=torch.int64, device=self.device
        )
        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        tokens, n = (int(x) for x in counts.tolist())
        if tokens == 0 and not allow_empty:
            raise ValueError("the global batch holds no response tokens")
        return tokens, n

    # ---- state ----------------------------------------------------------------------

    def gradients(self) -> dict[str, torch.Tensor]:
        """Trainable parameters' accumulated (synced) gradients in the fp32 grad buffer.

        With the distributed optimizer each rank holds only its reduced shard of the buffer.
        Empty after `release_gradients()`, until the next `forward_backward`.
        """
        if self.gradients_released:
            return {}
        return {name: p.main_grad for name, p in self.module.named_parameters() if p.requires_grad}

    def named_weights_for_publication(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every physical tensor under its HF name (frozen exit gate included), in model
        dtype, for the engine's weight update. Tensors alias the live parameters: copy
        them before the next step if they must outlive it. The parameters are the physical
        tensors (the model has no buffers); walking them skips `state_dict`'s module
        recursion and hooks, which cost milliseconds per publication at 1.4B."""
        for name, param in self.module.named_parameters():
            yield name, param.detach()

    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied so far (restored by `load`)."""
        return int(self.scheduler.num_steps)

    @property
    def model(self) -> OuroForCausalLM:
        """The underlying OuroForCausalLM (shares parameters with the trainer)."""
        return self.module.ouro

    def save(
        self,
        root: str | Path,
        iteration: int,
        extra: dict | None = None,
        *,
        before_commit: Callable[[Path], None] | None = None,
        after_commit: Callable[[Path], None] | None = None,
    ) -> Path | None:
        """Checkpoint the full training state as iteration `iteration` of `root`. With
        `config.async_save` the write goes on in the background and this returns None: the
        next save, `load`, `wait_for_save` and `close` commit it first (then `after_commit`)."""
        self.wait_for_save()
        with self.megatron_context():
            done = checkpointing.save(
                Path(root),
                iteration,
                module=self.module,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                on_cuda=self._on_cuda,
                extra=extra,
                keep_last=self.config.keep_last,
                before_commit=before_commit,
                async_save=self.config.async_save,
            )
        if isinstance(done, checkpointing.PendingSave):
            self._pending_save = (done, after_commit)
            return None
        if after_commit is not None:
            after_commit(done)
        return done

    def wait_for_save(self) -> Path | None:
        """Commit a background save still being written (collective call): the iteration it made,
        or None when none was pending."""
        if self._pending_save is None:
            return None
        pending, after_commit = self._pending_save
        self._pending_save = None
        with self.megatron_context():
            done = checkpointing.finish(pending)
        if after_commit is not None:
            after_commit(done)
        return done

    def load(self, root: str | Path) -> dict:
        """Restore model, optimizer, scheduler and RNG from the latest iteration; returns `extra`."""
        self.wait_for_save()
        with self.megatron_context():
            iteration, extra = checkpointing.load(
                Path(root),
                module=self.module,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                on_cuda=self._on_cuda,
            )
        if self.offload is not None:
            self.offload.to_host()  # loading may have created state tensors on the device
        self.loaded_iteration = iteration
        return extra

    def close(self) -> None:
        """Commit a background save still being written (a later failure does not make it
        invalid: its records were written before it), then leave the process group."""
        try:
            self.wait_for_save()
        finally:
            setup.shutdown(self.context)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def megatron_context(self):
        """The context in which megatron-core's calls on this trainer run (setup.megatron_context)."""
        return setup.megatron_context(self.config)

    # ---- internals ------------------------------------------------------------------

    @property
    def _on_cuda(self) -> bool:
        return self.device.type == "cuda"
