"""One GRPO step: forward/backward over the micro-batches, gradient sync, optimizer step.

    zero grad buffers
    for each micro-batch:  replay forward -> clipped surrogate (weighed or masked by
                           --is-correction, is_correction.py; dual clip, trainer/loss.py)
                           -> backward (accumulate)
    DDP grad sync (all-reduce, or reduce-scatter for the distributed optimizer)
    optimizer step (clip, Adam) -> LR scheduler step

Under loop weighting (config.loop_weighting other than "exit") the replay's `state_sink`
hands over every loop's exit state; the scored positions' states give each executed loop's
log-probability (`loop_logprobs`, lm_head recomputed in backward), the per-loop weights come
from loss.loop_weights, and the surrogate is fed loss.weighted_score. With "exit" no sink is
passed and nothing extra runs.

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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ouro_cli.model.ouro import LoopCounts
from ouro_cli.testing import faults

from .batching import MicroBatch, WorkCounter, tokens_past
from .config import TrainerConfig
from .determinism import deterministic_kernels
from .is_correction import correct
from .loss import clipped_surrogate, entropy, loop_weights, token_logprobs, weighted_score

# Indices into the summed statistics vector.
_SUMS = (
    "loss",
    "clipped",
    "ratio",
    "entropy",
    "mismatch",
    "scored_tokens",
    "samples",
    "layer_tokens_executed",
    "layer_tokens_recomputed",
    "layer_tokens_required",
    "tokens",
    "padded_tokens",
    "loop_passes",
    "gathered_loop_passes",
    "is_weight",
    "is_masked",
)
_MAXES = ("ratio_max", "mismatch_max", "micro_batches", "micro_batch_tokens_max", "is_weight_max")


@dataclass
class StepProgress:
    """Where the trainer's current update stands, for a display to read from another thread:
    step `step` of `steps` (Trainer.train_update's mini-batches × epochs), and of its
    `micro_batches` micro-batches, `micro_batch` have queued their backward. The trainer only
    assigns these counters; it never waits for a reader."""

    step: int = 0
    steps: int = 0
    micro_batch: int = 0
    micro_batches: int = 0


def forward_backward(
    ddp_model,
    micro_batches: Sequence[MicroBatch],
    config: TrainerConfig,
    device: torch.device,
    num_layers: int,
    num_loops: int,
    model=None,
    whole: dict[str, int] | None = None,
    progress: StepProgress | None = None,
) -> dict[str, float]:
    """Accumulate the gradients of all micro-batches into the grad buffers (no sync yet).
    `num_loops` (T) sizes the mismatch-by-depth statistics; `model` (the OuroForCausalLM)
    computes the per-loop log-probabilities of loop weighting. `whole` replaces the work
    counter's `layer_tokens_required` and `tokens` with those of the samples the micro-batches
    were cut from, where their parts replay a prompt twice (batching.split_prompts).
    `progress` counts the micro-batches as their backward is queued."""
    # Python numbers, or fp64 scalars on the device: the statistics are read back once, in
    # _reduce, not after every micro-batch (each read waits for the device to drain its queue)
    sums: dict = dict.fromkeys(_SUMS, 0.0)
    maxes: dict = dict.fromkeys(_MAXES, 0.0)
    zero = torch.zeros((), dtype=torch.float64, device=device)  # made there: no copy from the host
    maxes.update(ratio_max=zero, mismatch_max=zero, is_weight_max=zero)
    by_depth = MismatchByDepth(num_loops, device)  # one length on every rank: the vectors are all-reduced
    work = WorkCounter()
    per_loop = config.loop_weighting != "exit"
    weighted_loops = model.num_loops if per_loop else 0
    loop_sums = torch.zeros(weighted_loops, dtype=torch.float64, device=device)
    loop_counts = torch.zeros(weighted_loops, dtype=torch.float64, device=device)
    if progress is not None:
        progress.micro_batch, progress.micro_batches = 0, len(micro_batches)
    for index, host_mb in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        # Only the last backward may launch gradient reduction (matters with overlap_grad_reduce).
        sync = contextlib.nullcontext() if last else ddp_model.no_sync()
        mb = host_mb.to(device)
        # the loop plan's counts from the host copy: the forward then reads nothing back
        counts = LoopCounts.of(host_mb.depths, host_mb.attention_mask, num_loops)
        states: dict[int, torch.Tensor] = {}

        def keep_scored(loop: int, h: torch.Tensor, mb=mb, states=states) -> None:
            states[loop] = h[mb.score_rows, mb.score_cols]  # [N, H]: the scored positions only

        with sync, deterministic_kernels(device, config.deterministic):
            logits = scored_logits(ddp_model, mb, counts, config, keep_scored if per_loop else None)
            new, logp = token_logprobs(logits, mb.targets, mb.temperatures)
            del logits
            correction = correct(
                config.is_correction, config.is_bounds, new, mb.rollout_logprobs, mb.sample_ids, first=mb.first_logprobs
            )
            score = (
                _loop_weighted(
                    model,
                    config,
                    mb,
                    states,
                    new,
                    loop_sums,
                    loop_counts,
                    host_mb.depths[host_mb.score_rows, host_mb.score_cols],
                )
                if per_loop
                else new
            )
            del states
            terms = clipped_surrogate(
                score,
                correction.reference,
                mb.advantages,
                config.eps_low,
                config.eps_high,
                log_ratio_bound=config.log_ratio_bound,
                clip_ratio_c=config.clip_ratio_c,
            )
            loss = (terms.loss * mb.weights * correction.weight).sum()
            faults.simulated_train_limit(mb.padded_tokens)
            loss.backward()
        with torch.no_grad():
            mismatch = (new.detach() - mb.rollout_logprobs).abs()
            for key, value in (
                ("loss", loss.detach()),
                ("clipped", terms.clipped.sum()),
                ("ratio", terms.ratio.sum()),
                ("entropy", entropy(logp).sum()),
                ("mismatch", mismatch.sum()),
                ("is_weight", correction.weight.sum()),
                ("is_masked", correction.masked.sum()),
            ):
                sums[key] = sums[key] + value.double()
            for key, value in (
                ("ratio_max", terms.ratio.max()),
                ("mismatch_max", mismatch.max()),
                ("is_weight_max", correction.weight.max()),
            ):
                maxes[key] = torch.maximum(maxes[key], value.double())
            sums["scored_tokens"] += mb.targets.numel()
            sums["samples"] += mb.num_samples
            maxes["micro_batch_tokens_max"] = max(maxes["micro_batch_tokens_max"], mb.padded_tokens)
            by_depth.add(mismatch, mb.depths[mb.score_rows, mb.score_cols])
        maxes["micro_batches"] = len(micro_batches)
        work.add_micro_batch(host_mb, num_layers, config.recomputes, device_type=device.type, counts=counts)
        if progress is not None:
            progress.micro_batch = index + 1
    sums.update(work.as_dict(), **(whole or {}))
    out = _reduce(sums, maxes, by_depth, device)
    if per_loop:
        out.update(_reduce_loops(loop_sums, loop_counts, device))
    return out


def scored_logits(
    ddp_model, mb: MicroBatch, counts: LoopCounts, config: TrainerConfig, state_sink=None
) -> torch.Tensor:
    """The replay's logits [N, V] at the positions that score `mb`'s response tokens (on the
    device; `counts` its depths' LoopCounts; `state_sink` receives every loop's exit state)."""
    return ddp_model(
        mb.input_ids,
        mb.depths,
        attention_mask=mb.attention_mask,
        document_ids=mb.document_ids,
        recompute=config.recomputes,
        logits_at=(mb.score_rows, mb.score_cols),
        depth_counts=counts,
        **({"state_sink": state_sink} if state_sink is not None else {}),
    )


def replay_logprobs(
    ddp_model, micro_batches: Sequence[MicroBatch], config: TrainerConfig, device: torch.device, num_loops: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per micro-batch, (the logprobs [N] of its scored tokens at the current weights, its
    `weights` [N]), on the device; no gradient is kept. It is `forward_backward`'s forward, grad
    mode included, and the graph is dropped: compiled regions and exact mode's functions branch
    on grad mode, so a no-grad forward could round otherwise, while this one gives the logprobs
    the next step's forward computes from the same weights and micro-batches, bit for bit."""
    out = []
    for host_mb in micro_batches:
        mb = host_mb.to(device)
        counts = LoopCounts.of(host_mb.depths, host_mb.attention_mask, num_loops)
        with deterministic_kernels(device, config.deterministic):  # no reference to the graph outlives the line
            logprobs = token_logprobs(scored_logits(ddp_model, mb, counts, config), mb.targets, mb.temperatures)[
                0
            ].detach()
        out.append((logprobs, mb.weights))
    return out


def _loop_weighted(
    model,
    config: TrainerConfig,
    mb: MicroBatch,
    states: dict[int, torch.Tensor],
    exit_logprobs: torch.Tensor,
    loop_sums: torch.Tensor,
    loop_counts: torch.Tensor,
    host_depth: torch.Tensor,
) -> torch.Tensor:
    """The log-probability the surrogate gets under loop weighting (loss.weighted_score), from the
    scored positions' loop states; adds each loop's log-probabilities and token count to the sums.
    `host_depth` is the scored positions' depths on the host (the micro-batch's host copy)."""
    depth = mb.depths[mb.score_rows, mb.score_cols]
    past = tokens_past(host_depth, sorted(states))
    per_loop = loop_logprobs(model, states, depth, exit_logprobs, mb.targets, mb.temperatures, past)
    lambdas = None
    if config.loop_weighting == "exit-pdf":
        with torch.no_grad():  # the gate is frozen: its distribution only weighs
            lambdas = torch.stack([model.exit_lambda(states[t].detach()) for t in sorted(states)], -1)
    omega = loop_weights(
        depth,
        len(states),
        config.loop_weighting,
        alpha=config.loop_weight_alpha,
        lambdas=lambdas,
        num_loops=model.num_loops,
    )
    with torch.no_grad():
        ran = torch.arange(1, len(states) + 1, device=depth.device)[None, :] <= depth[:, None]
        loop_sums[: len(states)] += (per_loop.detach() * ran).sum(0).double()
        loop_counts[: len(states)] += ran.sum(0).double()
    return weighted_score(exit_logprobs, per_loop, omega)


def loop_logprobs(
    model,
    states: dict[int, torch.Tensor],
    depth: torch.Tensor,
    exit_logprobs: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    past: list[int],
) -> torch.Tensor:
    """log π^(t)(target) [N, L] for t = 1..L (L = the loops run): the exit loop's is `exit_logprobs`,
    a loop t < d gets its own logits from its exit state (only the tokens that ran past t), a
    loop t > d is 0 (weighted 0). Each loop's logits are recomputed in the backward pass instead
    of kept (torch checkpoint): what stays is the [n, H] state, not [n, V] log-softmax. `past`
    holds how many tokens ran past each loop of `states` (sorted), counted by the caller on the
    host (`batching.tokens_past`), so nothing is read back from the device."""
    columns = []
    loops = sorted(states)
    for t, n in zip(loops, past, strict=True):
        inner = torch.nonzero_static(depth > t, size=n).squeeze(-1)
        column = torch.zeros_like(exit_logprobs)
        if inner.numel():
            lp = checkpoint(
                _logprob_at, model, states[t][inner], targets[inner], temperatures[inner], use_reentrant=False
            )
            column = column.index_put((inner,), lp)
        columns.append(torch.where(depth == t, exit_logprobs, column))
    return torch.stack(columns, -1)


def _logprob_at(model, h: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    return token_logprobs(model.logits(h), targets, temperatures)[0]


def _reduce_loops(sums: torch.Tensor, counts: torch.Tensor, device: torch.device) -> dict[str, list]:
    """Per loop t: the mean log-probability of the sampled tokens that ran loop t (None where none
    did), and how many did, over data-parallel ranks."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    both = torch.stack([sums, counts])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(both, group=group)
    s, c = both.tolist()
    return {
        "loop_logprob_sum": s,
        "loop_tokens": [int(x) for x in c],
        "loop_logprob_mean": [a / n if n else None for a, n in zip(s, c, strict=True)],
    }


class MismatchByDepth:
    """|engine − trainer| logprob per exit depth of the scored token (the loops that produced
    it: its scoring position's depth; the first response token is scored at the prompt's T),
    summed, counted and maximised on the device (fp64 [T] vectors, reductions of a fixed shape:
    no atomics, the same bits in every run)."""

    def __init__(self, num_loops: int, device: torch.device) -> None:
        self.sums, self.counts, self.maxes = (
            torch.zeros(num_loops, dtype=torch.float64, device=device) for _ in range(3)
        )

    def add(self, mismatch: torch.Tensor, depths: torch.Tensor) -> None:
        loops = torch.arange(1, self.sums.shape[0] + 1, device=depths.device)
        at = depths[:, None] == loops[None, :]  # [N, T]: which depth scored each token
        values = torch.where(at, mismatch.double()[:, None], 0.0)
        self.sums += values.sum(0)
        self.counts += at.sum(0).double()
        self.maxes = torch.maximum(self.maxes, values.amax(0) if values.numel() else self.maxes)

    def vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.sums, self.counts]), self.maxes


def _reduce(sums: dict, maxes: dict, by_depth: MismatchByDepth, device: torch.device) -> dict[str, float]:
    """Sum / max over data-parallel ranks, then turn sums into per-token means: the step's one
    read of its statistics (Python numbers and fp64 device scalars, `forward_backward`)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    depth_sums, depth_maxes = by_depth.vectors()
    loops = by_depth.sums.shape[0]

    def vector(values: dict, keys: tuple[str, ...], tail: torch.Tensor) -> torch.Tensor:
        numbers = [k for k in keys if not isinstance(values[k], torch.Tensor)]  # one copy to the device for all
        moved = dict(
            zip(numbers, torch.tensor([values[k] for k in numbers], dtype=torch.float64).to(device), strict=True)
        )
        return torch.cat([*((moved[k] if k in moved else values[k]).reshape(1) for k in keys), tail])

    s, m = vector(sums, _SUMS, depth_sums), vector(maxes, _MAXES, depth_maxes)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(s, group=group)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    both = torch.cat([s, m]).tolist()
    s_list, m_list = both[: s.shape[0]], both[s.shape[0] :]
    total = dict(zip(_SUMS, s_list[: len(_SUMS)], strict=True)) | dict(zip(_MAXES, m_list[: len(_MAXES)], strict=True))
    depth_sum, depth_count = s_list[len(_SUMS) : len(_SUMS) + loops], s_list[len(_SUMS) + loops :]
    depth_max = m_list[len(_MAXES) :]
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
        "loop_passes": int(total["loop_passes"]),  # loops run, over micro-batches (and ranks)
        "gathered_loop_passes": int(total["gathered_loop_passes"]),  # those that gathered their positions
        "micro_batches": int(total["micro_batches"]),  # the most any rank ran
        "micro_batch_tokens_max": int(total["micro_batch_tokens_max"]),
        "is_weight_mean": total["is_weight"] / n,
        "is_weight_max": total["is_weight_max"],
        "is_masked_fraction": total["is_masked"] / n,
        # by exit depth, for the depths that scored tokens: where engine and trainer part
        "logprob_mismatch_mean_by_depth": {
            str(d + 1): depth_sum[d] / depth_count[d] for d in range(loops) if depth_count[d]
        },
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


# What `combine_steps` makes of each per-step metric.
_FIRST = (
    "logprob_mismatch_mean",
    "logprob_mismatch_max",
    "logprob_mismatch_mean_by_depth",
    "logprob_mismatch_max_by_depth",
    "lr",
)  # before any step moved the policy
_FIRST_EPOCH_SUMS = ("samples", "response_tokens", "tokens", "padded_tokens")  # the update's data, once
_ALL_SUMS = (
    "layer_tokens_executed",
    "layer_tokens_recomputed",
    "layer_tokens_required",
    "micro_batches",
    "loop_passes",
    "gathered_loop_passes",
    "forward_backward_s",
    "grad_sync_s",
    "optimizer_s",
)  # work and time
_TOKEN_MEANS = ("clip_fraction", "ratio_mean", "entropy", "is_weight_mean", "is_masked_fraction")
_MAX = ("ratio_max", "micro_batch_tokens_max", "is_weight_max")


def combine_steps(steps: Sequence[dict | None]) -> dict:
    """One update's metrics from its optimizer steps (`Trainer.train_update`; None: a mini-batch
    without tokens, no step). The replay mismatch and the LR are the first step's (the only
    one taken on the policy that sampled), overall and by exit depth; the data counts are the
    first epoch's; work and time add up; clip fraction, ratio, entropy and the importance
    correction's weight and masked share are token means over every step; `loss` is
    the mean of the steps' losses, `grad_norm` the largest (a non-finite one wins), and
    `step_applied` says every step was. One step gives that step's figures."""
    taken = [m for m in steps if m is not None]
    out: dict = {
        "optimizer_steps": sum(bool(m["step_applied"]) for m in taken),
        "empty_mini_batches": len(steps) - len(taken),
        "step_losses": [m["loss"] for m in taken],
        "grad_norms": [m["grad_norm"] for m in taken],
        "lrs": [m["lr"] for m in taken],
        "step_applied": all(m["step_applied"] for m in taken),
    }
    if not taken:
        return {**out, "loss": None, "grad_norm": None, "lr": None, **dict.fromkeys(_FIRST_EPOCH_SUMS, 0)}
    first_epoch = [m for m in taken if m.get("epoch", 0) == taken[0].get("epoch", 0)]
    tokens = sum(m["response_tokens"] for m in taken)
    norms = [m["grad_norm"] for m in taken]
    out.update({key: taken[0][key] for key in _FIRST})
    out.update({key: sum(m[key] for m in first_epoch) for key in _FIRST_EPOCH_SUMS})
    out.update({key: sum(m.get(key, 0) for m in taken) for key in _ALL_SUMS})
    out.update({key: sum(m[key] * m["response_tokens"] for m in taken) / max(tokens, 1) for key in _TOKEN_MEANS})
    out.update({key: max(m[key] for m in taken) for key in _MAX})
    out["loss"] = sum(m["loss"] for m in taken) / len(taken)
    out["grad_norm"] = next((n for n in norms if not math.isfinite(n)), max(norms))
    if "loop_logprob_sum" in taken[0]:
        sums = [sum(x) for x in zip(*(m["loop_logprob_sum"] for m in taken), strict=True)]
        counts = [sum(x) for x in zip(*(m["loop_tokens"] for m in taken), strict=True)]
        out["loop_tokens"] = counts
        out["loop_logprob_mean"] = [s / c if c else None for s, c in zip(sums, counts, strict=True)]
    return out
