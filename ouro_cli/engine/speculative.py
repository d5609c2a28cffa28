"""Self-speculative decoding: a shallow draft of the same weights, verified at full depth T.

A looped model is its own draft model: running `draft_loops` (D < T) loops of the shared
layers is a cheaper, slightly different policy. One speculative step of a sequence whose
newest token x_0 sits at position p (the cache holds positions < p, all at depth T):

1. Draft: n = `Sequence.lookahead` (≤ N) single-token decode steps at D loops feed
   x_0, d_1, …, d_{n-1} and sample d_i ~ q_i, the draft's processed distribution at the
   request's temperature (top-k / top-p included), from the request's own stream.
   Their K/V land at positions p..p+n-1 (depth D, last-exited layout).
2. Verify: one batched decode call runs x_0, d_1, …, d_n at positions p..p+n through
   all T loops. Each row attends over its own prefix; inside a layer every row writes
   its K/V before any row attends, so row i sees rows < i at the same loop and layer —
   causal attention over the block, and every one of the T planes at p..p+n is
   overwritten with full-depth K/V. The draft's planes are gone; the cache holds
   exactly what plain full-depth decoding would hold (the trainer replay's state with
   depths all T). Rows are batch-invariant (runner/paged_attention), so row i computes
   what a single-token step at p+i would. Its logits give p_{i+1}, the target.
3. Accept (Leviathan et al. / Chen et al. speculative sampling): d_i is accepted with
   probability min(1, p_i(d_i) / q_i(d_i)) (one uniform from the request's stream);
   at the first rejection the token is drawn from normalize(max(0, p_i − q_i)) and the
   step ends; if all n are accepted a bonus token is drawn from p_{n+1}. The emitted
   tokens are then distributed exactly as sampling from the target, token by token.
4. Roll back: the sequence keeps the K/V of its new inputs only (num_cached = p + emitted
   tokens); the slots of rejected drafts lie past its length and are overwritten later.

Every emitted token reports depth T and the target's log-probability (processed, or raw
if asked), so the trainer replays it with depths [T]*m + [T]*n. Work counters count all
draft and verification rows, rejected ones included; `spec_accepted_tokens /
spec_draft_tokens` is the acceptance rate. Greedy requests (temperature 0) accept a
draft iff it equals the target's argmax and draw nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ouro_cli.settings import executing

from .exits import ExitPolicy
from .request_rng import RequestRng, exponential, uniform
from .runner import ModelRunner, WorkCounters
from .sampling import SamplingBatch, processed_logprobs, raw_logprobs, sample
from .scheduler import Scheduler, Sequence

# (sequence, token, depth, logprob, scheduler) -> whether the sequence finished: EngineCore.emit
Emit = Callable[[Sequence, int, int, float, Scheduler], bool]


def accept_draft(target_lp: torch.Tensor, draft_lp: torch.Tensor, token: int, rng: RequestRng) -> bool:
    """Accept draft `token` with probability min(1, p(token) / q(token)) (log-probabilities [V])."""
    u = uniform([rng.next_key()], 1, target_lp.device)[0, 0]
    ratio = torch.exp(target_lp[token] - draft_lp[token])
    return bool(u < ratio)


def residual_token(target_lp: torch.Tensor, draft_lp: torch.Tensor, rng: RequestRng) -> int:
    """A draw from normalize(max(0, p − q)): the correction after a rejected draft.

    Exponential-race sampling (argmax r / E, as sampling.sample) needs no normalisation.
    A rejection implies p(x) < q(x) somewhere and so mass elsewhere; should rounding leave
    none, the target itself is sampled."""
    resid = (target_lp.exp() - draft_lp.exp()).clamp_min(0.0)
    if not bool(resid.sum() > 0):
        resid = target_lp.exp()
    noise = exponential([rng.next_key()], resid.shape[-1], resid.device)[0]
    return int(torch.argmax(resid / noise))


def _batch(seqs: list[Sequence], device: torch.device) -> SamplingBatch:
    ps = [s.params for s in seqs]
    return SamplingBatch(
        [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps], [s.rng for s in seqs], device
    )


class Speculator:
    """Runs speculative steps on an engine core's runner (which owns the model and the cache),
    counting into its counters and handing each accepted token to `emit`."""

    def __init__(self, runner: ModelRunner, counters: WorkCounters, emit: Emit) -> None:
        self.runner, self.counters, self.emit = runner, counters, emit

    @torch.no_grad()
    def step(self, seqs: list[Sequence], sched: Scheduler) -> None:
        """One speculative step (draft, verify, accept, roll back) of each of `seqs`, which own
        KV slots for their lookahead (the scheduler reserved them). Its logprobs are computed
        under the model's execution settings, as the decode step's are."""
        with executing(self.runner.model.execution):
            self._step(seqs, sched)

    def _step(self, seqs: list[Sequence], sched: Scheduler) -> None:
        runner, counters = self.runner, self.counters
        num_loops, device, layers = runner.num_loops, runner.kv.device, runner.num_layers
        n = {id(s): s.lookahead for s in seqs}
        inputs = {id(s): [s.output[-1]] for s in seqs}
        draft_lp: dict[int, list[torch.Tensor]] = {id(s): [] for s in seqs}

        # 1. draft: step i feeds input i of every sequence that drafts more than i tokens
        for i in range(max(n.values())):
            rows = [s for s in seqs if n[id(s)] > i]
            logits, _ = runner.decode(
                [inputs[id(s)][i] for s in rows],
                [s.num_cached + i for s in rows],
                [s.blocks for s in rows],
                [ExitPolicy.fixed(s.params.draft_loops) for s in rows],
            )
            batch = _batch(rows, device)
            q = processed_logprobs(logits, batch)
            tokens = sample(q, batch).tolist()
            for j, (s, tok) in enumerate(zip(rows, tokens, strict=True)):
                inputs[id(s)].append(tok)
                draft_lp[id(s)].append(q[j])
            counters.decode_layer_tokens += sum(s.params.draft_loops for s in rows) * layers

        # 2. verify: x_0, d_1..d_n of every sequence in one full-depth call
        owners = [(s, i) for s in seqs for i in range(n[id(s)] + 1)]
        logits, _ = runner.decode(
            [inputs[id(s)][i] for s, i in owners],
            [s.num_cached + i for s, i in owners],
            [s.blocks for s, _ in owners],
            [ExitPolicy.fixed(num_loops)] * len(owners),
        )
        counters.decode_layer_tokens += len(owners) * num_loops * layers
        counters.spec_verify_rows += len(owners)
        target = processed_logprobs(logits, _batch([s for s, _ in owners], device))
        raw = raw_logprobs(logits) if any(s.params.logprobs_mode == "raw" for s in seqs) else None

        # 3. accept, correct or add the bonus token; 4. roll back to the emitted inputs
        row = 0
        for s in seqs:
            k = n[id(s)]
            p_rows, drafts = target[row : row + k + 1], inputs[id(s)][1:]
            greedy = s.params.temperature <= 0
            emitted: list[tuple[int, int]] = []  # (token, verify row that scored it)
            for i, d in enumerate(drafts):
                ok = int(p_rows[i].argmax()) == d if greedy else accept_draft(p_rows[i], draft_lp[id(s)][i], d, s.rng)
                if ok:
                    emitted.append((d, i))
                    continue
                c = int(p_rows[i].argmax()) if greedy else residual_token(p_rows[i], draft_lp[id(s)][i], s.rng)
                emitted.append((c, i))
                break
            else:
                bonus = sample(p_rows[k : k + 1], _batch([s], device))
                emitted.append((int(bonus[0]), k))
            counters.spec_draft_tokens += k
            counters.spec_accepted_tokens += len(emitted) - 1  # all but the correction / bonus token
            s.num_cached += len(emitted)
            for tok, i in emitted:
                if s.params.logprobs_mode == "raw":
                    lp = float(raw[row + i, tok])
                else:  # a greedy row sampled a point mass (sampling.token_logprobs)
                    lp = 0.0 if greedy else float(target[row + i, tok])
                if self.emit(s, tok, num_loops, lp, sched):
                    break
            row += k + 1
