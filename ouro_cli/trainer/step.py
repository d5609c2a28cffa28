"""One GRPO step: forward/backward over the micro-batches, gradient sync, optimizer step.

    zero grad buffers
    for each micro-batch:  replay forward -> clipped surrogate -> backward (accumulate)
    DDP grad sync (all-reduce, or reduce-scatter for the distributed optimizer)
    optimizer step (clip, Adam) -> LR scheduler step

Gradients accumulate in Megatron's fp32 grad buffers. Each micro-batch's loss carries
global weights (batching.loss_weights), and DDP sums across ranks
(`calculate_per_token_loss`), so the accumulated gradient is exactly the gradient of
the global-batch loss however the batch is split over ranks and micro-batches.
Statistics are reduced over data-parallel ranks so every rank reports the same numbers.
On CUDA the forward and backward run with deterministic kernels (determinism.py), so a
step is a function of its inputs and a resumed run repeats the continuous one bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .batching import MicroBatch, WorkCounter
from .config import TrainerConfig
from .determinism import deterministic_kernels
from .loss import clipped_surrogate, entropy, token_logprobs

# Indices into the summed statistics vector.
_SUMS = ("loss", "clipped", "ratio", "entropy", "mismatch", "scored_tokens", "samples",
         "layer_tokens_executed", "layer_tokens_recomputed", "layer_tokens_required", "tokens", "padded_tokens")
_MAXES = ("ratio_max", "mismatch_max", "micro_batches", "micro_batch_tokens_max")


def forward_backward(ddp_model, micro_batches: Sequence[MicroBatch], config: TrainerConfig,
                     device: torch.device, num_layers: int) -> dict[str, float]:
    """Accumulate the gradients of all micro-batches into the grad buffers (no sync yet)."""
    sums = dict.fromkeys(_SUMS, 0.0)
    maxes = dict.fromkeys(_MAXES, 0.0)
    work = WorkCounter()
    for index, mb in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        # Only the last backward may launch gradient reduction (matters with overlap_grad_reduce).
        sync = contextlib.nullcontext() if last else ddp_model.no_sync()
        mb = mb.to(device)
        with sync, deterministic_kernels(device, config.deterministic):
            logits = ddp_model(  # [N, V]: only where a response token is scored
                mb.input_ids, mb.depths, attention_mask=mb.attention_mask, document_ids=mb.document_ids,
                recompute=config.recomputes, logits_at=(mb.score_rows, mb.score_cols),
            )
            new, logp = token_logprobs(logits, mb.targets, mb.temperatures)
            del logits
            terms = clipped_surrogate(new, mb.rollout_logprobs, mb.advantages, config.eps_low, config.eps_high)
            loss = (terms.loss * mb.weights).sum()
            loss.backward()
        with torch.no_grad():
            mismatch = (new.detach() - mb.rollout_logprobs).abs()
            sums["loss"] += float(loss.detach())
            sums["clipped"] += float(terms.clipped.sum())
            sums["ratio"] += float(terms.ratio.sum())
            sums["entropy"] += float(entropy(logp).sum())
            sums["mismatch"] += float(mismatch.sum())
            sums["scored_tokens"] += mb.targets.numel()
            sums["samples"] += mb.num_samples
            maxes["ratio_max"] = max(maxes["ratio_max"], float(terms.ratio.max()))
            maxes["mismatch_max"] = max(maxes["mismatch_max"], float(mismatch.max()))
            maxes["micro_batch_tokens_max"] = max(maxes["micro_batch_tokens_max"], mb.padded_tokens)
        maxes["micro_batches"] = len(micro_batches)
        work.add_micro_batch(mb, num_layers, config.recomputes)
    sums.update(work.as_dict())
    return _reduce(sums, maxes, device)


def _reduce(sums: dict[str, float], maxes: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum / max over data-parallel ranks, then turn sums into per-token means."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    s = torch.tensor([sums[k] for k in _SUMS], dtype=torch.float64, device=device)
    m = torch.tensor([maxes[k] for k in _MAXES], dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(s, group=group)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    total = dict(zip(_SUMS, s.tolist(), strict=True)) | dict(zip(_MAXES, m.tolist(), strict=True))
    n = max(total["scored_tokens"], 1.0)
    return {
        "loss": total["loss"],
        "clip_fraction": total["clipped"] / n,
        "ratio_mean": total["ratio"] / n,
        "ratio_max": total["ratio_max"],
        "entropy": total["entropy"] / n,
        "logprob_mismatch_mean": total["mismatch"] / n,
        "logprob_mismatch_max": total["mismatch_max"],
        "samples": int(total["samples"]),
        "response_tokens": int(total["scored_tokens"]),
        "tokens": int(total["tokens"]),
        "padded_tokens": int(total["padded_tokens"]),
        "layer_tokens_executed": int(total["layer_tokens_executed"]),
        "layer_tokens_recomputed": int(total["layer_tokens_recomputed"]),
        "layer_tokens_required": int(total["layer_tokens_required"]),
        "micro_batches": int(total["micro_batches"]),  # the most any rank ran
        "micro_batch_tokens_max": int(total["micro_batch_tokens_max"]),
    }


def optimizer_step(optimizer, scheduler) -> dict[str, float]:
    """Clip + Adam on the synced gradients, then advance the LR schedule, unless a gradient
    is not finite.

    Returns the LR the step used, the global gradient norm before clipping, and whether
    the step was applied. Megatron's `step()` prepares the gradients (`prepare_grads`,
    which reports found_inf under loss scaling), takes their global norm, clips and
    steps, but its fp32 and bf16 optimizers apply a NaN or inf gradient all the same. So
    the norm is taken first, by the calls `step()` makes (the same value); found_inf or a
    non-finite norm skips the step and the schedule. Preparing twice is idempotent
    without a loss scaler, and ouro's fp32/bf16 optimizers have none.
    """
    lr = float(optimizer.param_groups[0]["lr"])
    found_inf = optimizer.prepare_grads()
    grad_norm = float("nan") if found_inf else float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        return {"lr": lr, "grad_norm": grad_norm, "step_applied": False}
    applied, _, _ = optimizer.step()
    if applied:
        scheduler.step(increment=1)
    return {"lr": lr, "grad_norm": grad_norm, "step_applied": bool(applied)}


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed
