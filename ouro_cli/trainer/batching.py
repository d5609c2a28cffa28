"""From rollout samples to packed micro-batches, and the work they cost.

A `Sample` is one rollout: prompt p (m tokens), response r (n tokens), the loops each
response token was produced with (`exit_depths`, n entries, docs/model.md §3), the rollout's
log-probabilities of r and the sample's advantage; under `--is-correction` with several
optimizer steps per update also the trainer's log-probabilities of r under the update's first
policy (`first_logprobs`, Trainer.train_update). The trainer replays `p + r` with
depths `[T]*m + exit_depths[1:] + [T]`; position m-1 scores r[0], position m+j-1
scores r[j].

Micro-batches (`plan_micro_batches`): the local samples are cut, in order, into groups
that each become one forward/backward: at most `micro_batch_size` samples, and at most
`max_tokens` positions in the group's tensor (rows × row capacity, padding included), so
a token budget sized from free memory bounds every micro-batch's activations. Given a
`TokenCost`, the budget counts full-depth positions instead: a position costs the share of
one that runs every loop which the loops it really runs keep for backward, so a batch of
shallow responses (K = 2: the prompt alone runs loops 3 and 4) packs more of them. With
`pack` the samples are laid end to end in rows of `pack_length` tokens (default: the
longest local sample; first fit, in order), with `document_ids` so no sample attends to
another and RoPE positions restart per sample; otherwise each sample gets its own
right-padded row. Either way the loss is a sum of
per-token terms with weights fixed by the *global* batch (token count or sample count
over all ranks), so the gradient does not depend on how samples are grouped or packed.

Work counter: Ouro's replay runs loop t on the positions whose depth is at least t,
gathered, when they are fewer than a share of the micro-batch tensor, else on all of it
(padding and shallow tokens included, their results discarded; model/ouro.py
`GATHER_BELOW`), so the layer-token evaluations executed are, per loop, the positions it
ran × layers (`positions_per_loop`), and recompute runs them a second time in backward.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ouro_cli.errors import UserError
from ouro_cli.host_to_device import to_device
from ouro_cli.model.ouro import LoopCounts, loop_gathers, positions_per_loop


@dataclass
class Sample:
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    exit_depths: Sequence[int]
    rollout_logprobs: Sequence[float]
    advantage: float
    temperature: float = 1.0
    # a part of a split sample (`split_prompts`): the depth its prompt runs at (None: T), and
    # the first response token it scores (1: the sample's prompt head scores token 0)
    prompt_depth: int | None = None
    scored_from: int = 0
    # the trainer's logprobs of r under the update's first policy (is_correction.py); None: the
    # step that trains the sample is its update's only one
    first_logprobs: Sequence[float] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def check(self, num_loops: int) -> None:
        n = len(self.response_ids)
        if not self.prompt_ids or n == 0:
            raise UserError("a sample needs at least one prompt token and one response token")
        if len(self.exit_depths) != n or len(self.rollout_logprobs) != n:
            raise UserError(
                f"a sample with {n} response tokens needs {n} exit_depths and {n} rollout_logprobs, "
                f"got {len(self.exit_depths)} and {len(self.rollout_logprobs)}"
            )
        if self.first_logprobs is not None and len(self.first_logprobs) != n:
            raise UserError(
                f"a sample with {n} response tokens needs {n} first_logprobs, got {len(self.first_logprobs)}"
            )
        if any(not 1 <= int(d) <= num_loops for d in self.exit_depths):
            raise UserError(f"exit_depths must lie in 1..{num_loops}")
        if not self.temperature > 0:
            raise UserError("temperature must be > 0")

    def depths(self, num_loops: int) -> list[int]:
        """Per input position: full depth over the prompt (a body's: its `prompt_depth`), then each
        response token's loops; the last position scores nothing and influences nothing."""
        prompt = self.prompt_depth or num_loops
        return [prompt] * len(self.prompt_ids) + [int(d) for d in self.exit_depths[1:]] + [prompt]

    def depth_counts(self, num_loops: int) -> list[int]:
        """Per loop t = 1..T, how many of `depths(num_loops)` are ≥ t, counted from the exit depths
        without building that list."""
        at = Counter(map(int, self.exit_depths[1:]))
        at[self.prompt_depth or num_loops] += len(self.prompt_ids) + 1  # the prompt and the last position
        deeper = [0] * (num_loops + 1)
        for t in range(num_loops, 0, -1):
            deeper[t - 1] = deeper[t] + at[t]
        return deeper[:num_loops]

    def depth_sum(self, num_loops: int) -> int:
        """sum(self.depths(num_loops)): the loops its replay requires."""
        return sum(self.depth_counts(num_loops))

    @property
    def scored(self) -> int:
        return len(self.response_ids) - self.scored_from


# A split replays the prompt's loops 1..D twice (and the head one position more): (m + 1) · D
# layer-token evaluations. A sample is split only if that is at most this share of what its
# depths require, so executed / required stays within 1.05 (at 1.4B, 18 + 512 tokens at
# K = 2: 3.5 %); a long prompt, whose deep loops gather enough rows to fill the GPU, stays whole.
HEAD_OVERHEAD = 0.05


def split_prompts(
    samples: Sequence[Sample],
    weights: Sequence[Sequence[float]],
    num_loops: int,
    max_overhead: float = HEAD_OVERHEAD,
    deep_first: bool = True,
) -> tuple[list[Sample], list[list[float]]]:
    """Each sample whose response runs fewer than T loops everywhere as two parts, for the replay.

    A response token at loop t attends to the prompt's K/V at plane t, and planes 1..D never
    depend on deeper loops. So the sample's *body* — p + r with the prompt at depth D, the
    deepest response loop, scoring r[1:] — computes every one of those log-probabilities.
    Its *head* — the prompt at depth T, scoring r[0] from the last prompt position's loop T
    (docs/model.md §3) — computes the remaining one. The loss is the same function, each part
    carrying its tokens' global weights. A sample whose response reaches T, has one token, or
    whose prompt is too long for the repeat to pay (`max_overhead`), stays whole.

    Order (`deep_first`): the whole samples, then the heads, then the bodies, each in the
    samples' order. The parts that run the prompts' deep loops start the first micro-batch, so
    those loops run in as few micro-batches as they fill, instead of in every micro-batch that
    holds a whole sample (a loop over a few positions costs its layer calls' host time for
    almost no device work; why: docs/performance.md#train). Without `deep_first`: the bodies
    and the whole samples in the samples' order, then the heads. With nothing split, the
    samples stay as they were.
    -> (parts, their weights)."""
    parts, part_weights, whole, whole_weights, heads, head_weights = [], [], [], [], [], []
    for s, w in zip(samples, weights, strict=True):
        deepest = max((int(d) for d in s.exit_depths[1:]), default=num_loops)
        repeated = (len(s.prompt_ids) + 1) * deepest
        if deepest >= num_loops or repeated > max_overhead * s.depth_sum(num_loops):
            (whole if deep_first else parts).append(s)
            (whole_weights if deep_first else part_weights).append(list(w))
            continue
        parts.append(dataclasses.replace(s, prompt_depth=deepest, scored_from=1))
        part_weights.append(list(w[1:]))
        heads.append(
            Sample(
                s.prompt_ids,
                s.response_ids[:1],
                s.exit_depths[:1],
                s.rollout_logprobs[:1],
                s.advantage,
                s.temperature,
                first_logprobs=None if s.first_logprobs is None else s.first_logprobs[:1],
            )
        )
        head_weights.append([w[0]])
    if deep_first:
        return whole + heads + parts, whole_weights + head_weights + part_weights
    return parts + heads, part_weights + head_weights


@dataclass
class MicroBatch:
    """Tensors for one forward/backward and, per scored token, what the loss needs."""

    input_ids: torch.Tensor  # [R, S]
    depths: torch.Tensor  # [R, S]
    attention_mask: torch.Tensor | None  # [R, S] bool; None when no row is padded
    document_ids: torch.Tensor | None  # [R, S]; None when no row holds two samples
    score_rows: torch.Tensor  # [N] row of the position whose logits score each target
    score_cols: torch.Tensor  # [N] its column
    targets: torch.Tensor  # [N] the response token scored there
    rollout_logprobs: torch.Tensor  # [N] fp32
    first_logprobs: torch.Tensor | None  # [N] fp32 (Sample.first_logprobs); None when no sample has them
    advantages: torch.Tensor  # [N] fp32, the sample's advantage on each of its tokens
    temperatures: torch.Tensor  # [N] fp32
    weights: torch.Tensor  # [N] fp32, loss weight of each token (global normalisation)
    sample_ids: torch.Tensor  # [N] which sample of the micro-batch (0, 1, ...) each token belongs to
    num_samples: int
    real_tokens: int

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch on `device`; on CUDA queued, not waited for (host_to_device.to_device:
        a blocking copy would make the host wait for the last micro-batch's backward, once per
        tensor)."""
        return MicroBatch(
            **{k: (to_device(v, v.dtype, device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        )

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel()


@dataclass
class WorkCounter:
    """Layer-token evaluations: what Ouro's replay executed vs what the depths required."""

    executed: int = 0  # forward: layers × the positions each loop ran (model/ouro.py positions_per_loop)
    recomputed: int = 0  # backward re-runs of the forward (activation recompute)
    required: int = 0  # layers × Σ depth over real positions: the work a per-token executor does
    tokens: int = 0  # real (non-padding) positions
    padded_tokens: int = 0  # positions in the micro-batch tensors, padding included
    # loops run, summed over micro-batches, and those of them that gathered their positions: each
    # is a pass of every layer, whose host launch work does not shrink with its positions
    loop_passes: int = 0
    gathered_passes: int = 0

    def add_micro_batch(
        self,
        mb: MicroBatch,
        num_layers: int,
        recompute: bool,
        device_type: str | None = None,
        counts: LoopCounts | None = None,
    ) -> None:
        """Count `mb` (its host copy, so that counting reads nothing back from the device),
        replayed on `device_type` (default: where mb is), as model/ouro.py replays it there;
        `counts`: its depths' LoopCounts where the caller made them for the forward."""
        per_loop = positions_per_loop(mb.depths, mb.attention_mask, device_type=device_type, counts=counts)
        executed = num_layers * sum(per_loop)
        self.loop_passes += len(per_loop)
        self.gathered_passes += sum(n < mb.depths.numel() for n in per_loop)
        self.executed += executed
        self.recomputed += executed if recompute else 0
        real = mb.attention_mask if mb.attention_mask is not None else torch.ones_like(mb.depths, dtype=torch.bool)
        self.required += num_layers * int(mb.depths[real].sum())
        self.tokens += mb.real_tokens
        self.padded_tokens += mb.padded_tokens

    def as_dict(self) -> dict[str, int]:
        return {
            "layer_tokens_executed": self.executed,
            "layer_tokens_recomputed": self.recomputed,
            "layer_tokens_required": self.required,
            "tokens": self.tokens,
            "padded_tokens": self.padded_tokens,
            "loop_passes": self.loop_passes,
            "gathered_loop_passes": self.gathered_passes,
        }


def loss_weights(
    samples: Sequence[Sample], aggregation: str, global_tokens: int, global_samples: int, length: int | None = None
) -> list[list[float]]:
    """Per response token of each sample, its weight in the global-batch loss.

    token_mean: every response token of the global batch weighs 1 / (total response tokens);
    sequence_mean: each sample's token mean, averaged over all samples (1 / (n_i · samples));
    constant_length (Dr. GRPO): every token weighs 1 / (samples · `length`), the length budget,
    so a sample's weight grows with its length and no length is favoured by the normaliser.
    """
    if aggregation == "token_mean":
        return [[1.0 / global_tokens] * len(s.response_ids) for s in samples]
    if aggregation == "sequence_mean":
        return [[1.0 / (len(s.response_ids) * global_samples)] * len(s.response_ids) for s in samples]
    if aggregation == "constant_length":
        if length is None:
            raise ValueError("constant_length aggregation needs the length budget (aggregation_length)")
        return [[1.0 / (length * global_samples)] * len(s.response_ids) for s in samples]
    raise ValueError(f"unknown aggregation {aggregation!r}")


@dataclass(frozen=True)
class TokenCost:
    """What one position of a micro-batch keeps for backward, as a share of a position that runs
    all T loops: `loop` for each loop it runs, `idle` × `loop` for each loop that gathers other
    positions while it sits out (that loop's attention still takes a full copy of every
    position's K/V), and the rest, 1 − T·`loop`, whatever it runs (its logits, the masks).
    The run's memory plan derives both shares from its activation model (rl/sizing.py
    `token_cost_shares`); a group of full-depth positions costs exactly its positions."""

    loop: float
    idle: float = 0.0

    def of_group(self, positions: int, running: Sequence[int], *, gathers: bool = True) -> float:
        """The cost of a micro-batch tensor of `positions` (padding included) in which
        `running[t-1]` real positions have depth ≥ t: each loop executes the positions the
        replay runs it on (model/ouro.py `loop_gathers`; `gathers` False: every loop whole, as
        exact mode's torch path runs them, `gathering_allowed`)."""
        cost = positions * (1.0 - len(running) * self.loop)
        for n in running:
            if n == 0:  # no position is this deep: the replay stops before this loop
                break
            ran = n if loop_gathers(n, positions, may_gather=gathers) else positions
            cost += self.loop * (ran + self.idle * (positions - ran))
        return cost


def row_capacity(samples: Sequence[Sample], pack_length: int | None) -> int:
    """Tokens per packed row: `pack_length`, or the longest sample (so short samples share rows
    without making one giant row: dense attention over a row costs row_length²)."""
    longest = max((s.length for s in samples), default=1)
    if pack_length is not None and longest > pack_length:
        raise UserError(f"a sample of {longest} tokens does not fit pack_length={pack_length}; raise pack_length")
    return pack_length if pack_length is not None else longest


def plan_micro_batches(
    samples: Sequence[Sample],
    *,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
    pack: bool = True,
    pack_length: int | None = None,
    cost: TokenCost | None = None,
    num_loops: int = 0,
    gathers: bool = True,
) -> list[list[list[int]]]:
    """Micro-batches in order, each a list of rows, each row the indices of its samples.

    Rows are filled first fit, in order, up to the row capacity (`row_capacity`; without
    `pack` one sample per row, as wide as the longest local sample). A micro-batch closes
    when it holds `micro_batch_size` samples, or when the next sample needs a new row that
    would take rows × capacity past `max_tokens`; with a `cost` (and the model's `num_loops`,
    and whether the replay `gathers` loops), when the next sample would take the group's
    `TokenCost.of_group` past `max_tokens`: that of the tensor `build_micro_batch` makes of it
    (rows × the fullest row), never more than its positions, so that the loops the replay
    then gathers or runs whole are the ones counted. Which
    samples share a micro-batch never changes the gradient (the loss weights are global),
    only its summation order."""
    capacity = row_capacity(samples, pack_length if pack else None)
    if max_tokens is not None and capacity > max_tokens:
        raise UserError(
            f"a sample of {capacity} tokens does not fit a micro-batch of {max_tokens} tokens; "
            "raise --max-tokens-per-micro-batch"
        )
    weighted = cost is not None and max_tokens is not None
    batches: list[list[list[int]]] = []
    rows: list[list[int]] = []
    used: list[int] = []
    running = [0] * num_loops  # the open group's positions per depth ≥ t (weighted only)
    for i, s in enumerate(samples):
        target = next((r for r, u in enumerate(used) if u + s.length <= capacity), None) if pack else None
        full = micro_batch_size is not None and sum(map(len, rows)) >= micro_batch_size
        if weighted:  # the group's tensor as build_micro_batch makes it, with this sample placed
            fills = [*used, s.length] if target is None else [u + s.length * (r == target) for r, u in enumerate(used)]
            counts = s.depth_counts(num_loops)
            after = [a + b for a, b in zip(running, counts, strict=True)]
            over = cost.of_group(len(fills) * max(fills), after, gathers=gathers) > max_tokens
        else:
            over = target is None and max_tokens is not None and (len(rows) + 1) * capacity > max_tokens
        if rows and (full or over):
            batches.append(rows)
            rows, used, target = [], [], None
            running = [0] * num_loops
        if weighted:
            running = [a + b for a, b in zip(running, counts, strict=True)]
        if target is None:
            rows.append([i])
            used.append(s.length)
        else:
            rows[target].append(i)
            used[target] += s.length
    if rows:
        batches.append(rows)
    return batches


def tokens_past(depths: torch.Tensor, loops: Sequence[int]) -> list[int]:
    """How many of the host tensor `depths` exceed each loop of `loops` (loop weighting's count
    of the tokens whose logits it recomputes at a loop they ran past)."""
    return [int((depths > t).sum()) for t in loops]


class PlannedMicroBatches(Sequence[MicroBatch]):
    """The micro-batches of a plan (`plan_micro_batches`), each built on the host when it is
    asked for and not kept: the train step asks for micro-batch i + 1 after launching
    micro-batch i's backward, so building it overlaps the device's work instead of holding
    the device idle before the first forward."""

    def __init__(
        self,
        samples: Sequence[Sample],
        weights: Sequence[Sequence[float]],
        num_loops: int,
        plan: list[list[list[int]]],
        pad_id: int = 0,
    ) -> None:
        self.samples, self.weights, self.num_loops, self.plan, self.pad_id = samples, weights, num_loops, plan, pad_id

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return build_micro_batch(self.samples, self.weights, self.num_loops, rows=self.plan[index], pad_id=self.pad_id)


def build_micro_batch(
    samples: Sequence[Sample],
    weights: Sequence[Sequence[float]],
    num_loops: int,
    *,
    rows: list[list[int]],
    pad_id: int = 0,
) -> MicroBatch:
    """The tensors of one micro-batch: `rows` lists, per row, the indices (into `samples`) of
    the samples laid end to end in it."""
    width = max(sum(samples[i].length for i in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    depths = torch.ones(shape, dtype=torch.long)  # padding: depth 1 (any valid value; never read)
    valid = torch.zeros(shape, dtype=torch.bool)
    docs = torch.full(shape, -1, dtype=torch.long)
    score_rows, score_cols, targets, old, first, adv, temp, w, sample_of = [], [], [], [], [], [], [], [], []
    with_first = [samples[i].first_logprobs is not None for row in rows for i in row]
    if any(with_first) and not all(with_first):
        raise ValueError("a micro-batch mixes samples with and without first_logprobs")
    for r, row in enumerate(rows):
        col = 0
        for doc, i in enumerate(row):
            s = samples[i]
            m, n = len(s.prompt_ids), len(s.response_ids)
            span = slice(col, col + m + n)
            input_ids[r, span] = torch.tensor([*s.prompt_ids, *s.response_ids], dtype=torch.long)
            depths[r, span] = torch.tensor(s.depths(num_loops), dtype=torch.long)
            valid[r, span] = True
            docs[r, span] = doc
            f, k = s.scored_from, s.scored  # a body does not score r[0] (split_prompts)
            score_rows += [r] * k
            score_cols += range(col + m - 1 + f, col + m + n - 1)
            targets += [int(t) for t in s.response_ids[f:]]
            old += [float(x) for x in s.rollout_logprobs[f:]]
            first += [float(x) for x in s.first_logprobs[f:]] if s.first_logprobs is not None else []
            adv += [float(s.advantage)] * k
            temp += [float(s.temperature)] * k
            w += list(weights[i])
            sample_of += [sum(map(len, rows[:r])) + doc] * k  # the sample's index in the micro-batch
            col += m + n
    packed = any(len(row) > 1 for row in rows)
    padded = not bool(valid.all())
    f32 = dict(dtype=torch.float32)
    return MicroBatch(
        input_ids=input_ids,
        depths=depths,
        attention_mask=valid if padded else None,
        document_ids=docs.clamp(min=0) if packed else None,
        score_rows=torch.tensor(score_rows, dtype=torch.long),
        score_cols=torch.tensor(score_cols, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        rollout_logprobs=torch.tensor(old, **f32),
        first_logprobs=torch.tensor(first, **f32) if all(with_first) else None,
        advantages=torch.tensor(adv, **f32),
        temperatures=torch.tensor(temp, **f32),
        weights=torch.tensor(w, **f32),
        sample_ids=torch.tensor(sample_of, dtype=torch.long),
        num_samples=sum(samples[i].scored_from == 0 for row in rows for i in row),  # a head counts its sample
        real_tokens=int(valid.sum()),
    )
