"""ExitState.after_loop, the engine's per-loop exit bookkeeping (engine/exits.py): the
decisions it makes against the model's CDF (exit_gate.exit_cdf) for every policy, and the
compiled form it takes on CUDA (one fused kernel) against the eager one."""

from __future__ import annotations

import math

import torch

from ouro_cli.engine.exits import ExitState
from ouro_cli.model.exit_gate import exit_cdf
from ouro_cli.settings import executing
from tests.unit.model.compiling import ALWAYS, record_compiles

T = 4


def policies():
    """(stop_after, min_loops, tau, delay) rows: greedy thresholds, a minimum, delayed, a trace depth, never."""
    rows = [(T, 1, 0.3, 0), (T, 1, 0.6, 0), (T, 3, 0.2, 0), (T, 1, 0.4, 1), (2, 1, math.inf, 0), (T, 1, math.inf, 0)]
    rows = rows * 4
    stop, lo, tau, delay = zip(*rows, strict=True)
    return (torch.tensor(stop), torch.tensor(lo), torch.tensor(tau, dtype=torch.float32), torch.tensor(delay))


def run(lams: torch.Tensor) -> ExitState:
    stop, lo, tau, delay = policies()
    state = ExitState.start(stop, lo, tau, delay, max_loops=T, may_exit_early=True)
    for t in range(1, T + 1):
        state.after_loop(t, lams[:, t - 1])
    return state


def expected_depths(lams: torch.Tensor) -> list[int]:
    """docs/model.md §3 from the whole-sequence CDF: the first loop t >= min_loops with
    CDF_t >= tau, plus the delay, capped by stop_after."""
    stop, lo, tau, delay = policies()
    cdf = exit_cdf(lams)
    out = []
    for row in range(lams.shape[0]):
        fired = [t for t in range(1, T + 1) if t >= lo[row] and cdf[row, t - 1] >= tau[row]]
        depth = min(int(stop[row]), fired[0] + int(delay[row])) if fired else int(stop[row])
        out.append(min(depth, T))
    return out


def test_depths_follow_the_cdf():
    lams = torch.rand(24, T, generator=torch.Generator().manual_seed(0))
    state = run(lams)
    assert state.depth.tolist() == expected_depths(lams)
    assert len(set(state.depth.tolist())) >= 3  # the policies really part


def test_compiled_update_makes_the_eager_decisions(monkeypatch):
    """What CUDA runs (the update compiled by pointwise.fused) decides as eager does; the CDF
    may differ by an fp32 rounding where the compiler fuses a multiply-add."""
    lams = torch.rand(24, T, generator=torch.Generator().manual_seed(1))
    eager = run(lams)
    compiled_fns = record_compiles(monkeypatch)
    with executing(ALWAYS):
        compiled = run(lams)
    assert compiled_fns == ["_advance"] * T  # the update really ran compiled, once per loop
    for name in ("depth", "active", "stop_after"):
        assert torch.equal(getattr(eager, name), getattr(compiled, name)), name
    torch.testing.assert_close(compiled.cdf, eager.cdf, rtol=2e-7, atol=0)


def test_a_sequence_names_the_policy_of_each_row():
    """The policy a Sequence computed once gives each decode row what SamplingParams say
    (contract.py): a trace's depth for token j, K past the trace, the threshold's numbers."""
    from ouro_cli.engine.contract import SamplingParams
    from ouro_cli.engine.exits import ExitPolicy
    from ouro_cli.engine.request_rng import RequestRng
    from ouro_cli.engine.scheduler import Sequence

    def seq(**kw):
        p = SamplingParams(max_tokens=8, max_loops=3, **kw).resolved(T, 0)
        return Sequence(index=0, request_id="0", prompt=[1], params=p, rng=RequestRng(0), max_kv_tokens=9)

    traced = seq(exit_mode="trace", exit_trace=(2, 1, 4))
    depths = []
    for n in range(1, 7):  # the row that follows n generated tokens
        traced.output = [0] * n
        depths.append(traced.exit_policy())
        assert traced.exit_policy(ahead=1) == ExitPolicy(([2, 1, 4] + [3] * 9)[n], 1, math.inf, 0)
    assert depths == [ExitPolicy(d, 1, math.inf, 0) for d in (2, 1, 4, 3, 3, 3)]
    delayed = seq(exit_threshold=0.4, exit_mode="delayed", min_loops=2)
    delayed.output = [0, 0]
    assert delayed.exit_policy() == (3, 2, 0.4, 1) and delayed.exit_policy().tau == 0.4
    assert seq().exit_policy() == ExitPolicy(3, 1, math.inf, 0)
