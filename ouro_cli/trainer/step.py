"""One GRPO step: forward/backward over the micro-batches, gradient sync, optimizer step.

    zero grad buffers
    for each micro-batch:  replay forward -> clipped surrogate (weighed or masked by
                           --is-correction, is_correction.py) -> backward (accumulate)
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
from .is_correction import correct
from .loss import clipped_surrogate, entropy, token_logprobs

# Indices into the summed statistics vector.
_SUMS = ("loss", "clipped", "ratio", "entropy", "mismatch", "scored_tokens", "samples",
         "layer_tokens_executed", "layer_tokens_recomputed", "layer_tokens_required", "tokens", "padded_tokens",
         "is_weight", "is_masked")
_MAXES = ("ratio_max", "mismatch_max", "micro_batches", "micro_batch_tokens_max", "is_weight_max")


def forward_backward(ddp_model, micro_batches: Sequence[MicroBatch], config: TrainerConfig,
                     device: torch.device, num_layers: int, num_loops: int) -> dict[str, float]:
    """Accumulate the gradients of all micro-batches into the grad buffers (no sync yet).
    `num_loops` (T) sizes the mismatch-by-depth statistics."""
    sums = dict.fromkeys(_SUMS, 0.0)
    maxes = dict.fromkeys(_MAXES, 0.0)
    by_depth = MismatchByDepth(num_loops)  # one length on every rank: the vectors are all-reduced
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
            correction = correct(config.is_correction, config.is_bounds, new, mb.rollout_logprobs, mb.sample_ids)
            terms = clipped_surrogate(new, correction.reference, mb.advantages, config.eps_low, config.eps_high)
            loss = (terms.loss * mb.weights * correction.weight).sum()
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
            sums["is_weight"] += float(correction.weight.sum())
            sums["is_masked"] += float(correction.masked.sum())
            maxes["is_weight_max"] = max(maxes["is_weight_max"], float(correction.weight.max()))
            by_depth.add(mismatch, mb.depths[mb.score_rows, mb.score_cols])
        maxes["micro_batches"] = len(micro_batches)
        work.add_micro_batch(mb, num_layers, config.recomputes)
    sums.update(work.as_dict())
    return _reduce(sums, maxes, by_depth, device)


class MismatchByDepth:
    """|engine − trainer| logprob per exit depth of the scored token (the loops that produced
    it: its scoring position's depth; the first response token is scored at the prompt's T)."""

    def __init__(self, num_loops: int) -> None:
        self.sums, self.counts, self.maxes = ([0.0] * num_loops for _ in range(3))

    def add(self, mismatch: torch.Tensor, depths: torch.Tensor) -> None:
        for d in torch.unique(depths).tolist():
            at = mismatch[depths == d]
            self.sums[d - 1] += float(at.sum())
            self.counts[d - 1] += at.numel()
            self.maxes[d - 1] = max(self.maxes[d - 1], float(at.max()))

    def vectors(self) -> tuple[list[float], list[float]]:
        return self.sums + self.counts, self.maxes


def _reduce(sums: dict[str, float], maxes: dict[str, float], by_depth: MismatchByDepth,
            device: torch.device) -> dict[str, float]:
    """Sum / max over data-parallel ranks, then turn sums into per-token means."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    depth_sums, depth_maxes = by_depth.vectors()
    loops = len(by_depth.sums)
    s = torch.tensor([sums[k] for k in _SUMS] + depth_sums, dtype=torch.float64, device=device)
    m = torch.tensor([maxes[k] for k in _MAXES] + depth_maxes, dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(s, group=group)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s_list, m_list = s.tolist(), m.tolist()
    total = dict(zip(_SUMS, s_list[:len(_SUMS)], strict=True)) | dict(zip(_MAXES, m_list[:len(_MAXES)], strict=True))
    depth_sum, depth_count = s_list[len(_SUMS):len(_SUMS) + loops], s_list[len(_SUMS) + loops:]
    depth_max = m_list[len(_MAXES):]
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
        "is_weight_mean": total["is_weight"] / n,
        "is_weight_max": total["is_weight_max"],
        "is_masked_fraction": total["is_masked"] / n,
        # by exit depth, for the depths that scored tokens: where engine and trainer part
        "logprob_mismatch_mean_by_depth": {str(d + 1): depth_sum[d] / depth_count[d] for d in range(loops)
                                           if depth_count[d]},
        "logprob_mismatch_max_by_depth": {str(d + 1): depth_max[d] for d in range(loops) if depth_count[d]},
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
