"""Exit policies for decoding: how many loops each token of a batch runs (docs/model.md §3).

Every policy is reduced to four per-row numbers, an `ExitPolicy`, so that one batched,
branch-free update serves a batch that mixes them (and stays on the device, with no
host sync per loop, as a captured CUDA graph would need):

    stop_after  loops the row runs at most (K, or the trace's depth)
    min_loops   the first loop whose exit signal counts
    tau         the CDF threshold (+inf: the signal never fires; τ = 1 means exactly K)
    delay       0 (act after the loop that fired) or 1 (act one loop later: "delayed")

After loop t a row whose signal fires (t ≥ min_loops and CDF_t ≥ τ) lowers its
`stop_after` to min(stop_after, t + delay); a row is active at loop t + 1 while
t < stop_after. The CDF is accumulated with `exit_gate.cdf_step`, the same formula
the model code defines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ouro_cli.model import pointwise
from ouro_cli.model.exit_gate import cdf_step

from .contract import SamplingParams


class ExitPolicy(NamedTuple):
    """How many loops one decode row runs (the four numbers above). A NamedTuple: built
    once per request (`exit_policies`), it is as cheap to pass and unpack per step as a
    plain tuple."""

    stop_after: int
    min_loops: int
    tau: float
    delay: int

    @classmethod
    def fixed(cls, loops: int) -> ExitPolicy:
        """Exactly `loops` loops, no early exit (a draft, a verification or a padding row)."""
        return cls(loops, 1, math.inf, 0)


def row_policy(params: SamplingParams, num_generated: int) -> ExitPolicy:
    """The policy of the token that follows `num_generated` (>= 1) generated tokens.

    `params` must be resolved (max_loops set)."""
    k = params.max_loops
    assert k is not None
    if params.exit_mode == "trace":
        trace = params.exit_trace or ()
        return ExitPolicy.fixed(trace[num_generated - 1] if num_generated - 1 < len(trace) else k)
    tau = math.inf if params.exit_threshold >= 1.0 else params.exit_threshold
    return ExitPolicy(k, params.min_loops, tau, 1 if params.exit_mode == "delayed" else 0)


def exit_policies(params: SamplingParams) -> tuple[ExitPolicy, ...]:
    """Every policy a request's decode rows will use, computed once: entry
    min(n, len) - 1 is `row_policy(params, n)`. One entry unless the request replays a
    trace (then one per traced token, and K for the tokens past it)."""
    trace = params.exit_trace if params.exit_mode == "trace" else None
    return tuple(row_policy(params, n) for n in range(1, len(trace or ()) + 2))


@dataclass
class ExitState:
    """Per-row exit bookkeeping for one decode step of B rows (all tensors [B], on device)."""

    stop_after: torch.Tensor
    min_loops: torch.Tensor
    tau: torch.Tensor
    delay: torch.Tensor
    active: torch.Tensor
    depth: torch.Tensor
    cdf: torch.Tensor
    survive: torch.Tensor
    max_loops: int
    may_exit_early: bool

    @classmethod
    def start(
        cls,
        stop_after: torch.Tensor,
        min_loops: torch.Tensor,
        tau: torch.Tensor,
        delay: torch.Tensor,
        *,
        max_loops: int,
        may_exit_early: bool,
    ) -> ExitState:
        """A fresh state over given policy tensors (which are not modified: a captured graph reuses them)."""
        b, device = stop_after.shape[0], stop_after.device
        return cls(
            stop_after=stop_after.clone(),
            min_loops=min_loops,
            tau=tau,
            delay=delay,
            active=torch.ones(b, dtype=torch.bool, device=device),
            depth=torch.zeros(b, dtype=torch.long, device=device),
            cdf=torch.zeros(b, dtype=torch.float32, device=device),
            survive=torch.ones(b, dtype=torch.float32, device=device),
            max_loops=max_loops,
            may_exit_early=may_exit_early,
        )

    def after_loop(self, t: int, lam: torch.Tensor) -> None:
        """Account loop t (1-based) that just ran on the active rows; `lam` [B] is λ_t in fp32.
        One fused kernel where pointwise.py compiles (CUDA) instead of ~16 small ones per loop."""
        self.active, self.depth, self.cdf, self.survive, self.stop_after = pointwise.fused(_advance, lam)(
            t,
            lam,
            self.active,
            self.depth,
            self.cdf,
            self.survive,
            self.stop_after,
            self.min_loops,
            self.tau,
            self.delay,
        )


def _advance(t: int, lam, active, depth, cdf, survive, stop_after, min_loops, tau, delay):
    """ExitState.after_loop's update as a function of tensors -> (active, depth, cdf, survive, stop_after)."""
    depth = depth + active.long()
    new_cdf, new_survive = cdf_step(cdf, survive, lam)
    cdf = torch.where(active, new_cdf, cdf)
    survive = torch.where(active, new_survive, survive)
    fire = active & (min_loops <= t) & (cdf >= tau)
    stop_after = torch.where(fire, torch.minimum(stop_after, t + delay), stop_after)
    return active & (stop_after > t), depth, cdf, survive, stop_after
