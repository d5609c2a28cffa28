"""Ouro in PyTorch: one stack of layers applied up to T times per token (docs/model.md §2–3).

`OuroForCausalLM` owns the parameters under their physical Hugging Face names
(`model.layers.{i}...`, `model.norm`, `model.early_exit_gate`, `lm_head`): the
loops never duplicate a tensor. Two ways to run it share the same layer code:

- `forward(input_ids, depths=...)`: the whole sequence at once with a per-position
  depth vector. Loop t runs on positions whose depth ≥ t; every other position keeps
  the hidden state and the K/V of its own last loop ("last-exited" semantics), and
  logits are read at each position from its own last loop. This is the trainer's
  replay and the engine's prefill; no depths means full depth T everywhere.
- `run_loop(h, cos, sin, attend_for_layer)`: one loop for the caller's tokens with
  the caller's attention (the engine's paged KV cache drives decoding this way).

A loop runs the layer stack only on the positions that need it: those are gathered into
one row [1, N, H] for the projections, norms and MLP, their queries attend over every
position's keys (theirs new, the others' last-exited ones), and their exit states are
scattered back. A loop that (nearly) every position runs instead runs on all of them and
discards the rest with `torch.where`: gathering costs index copies of every activation,
which a few idle positions do not repay (`GATHER_BELOW`). Padding runs no loop where a loop
gathers. `positions_per_loop` says how many positions each loop ran: the trainer's count
of executed work.

`execution` (ouro_cli/settings.py) says how the model computes on a GPU: whether its
elementwise math compiles, whole layer calls as regions or not, and which attention the
replay uses. Both entry points run under it; whoever runs the model sets it (the trainer,
the engine), and a model built without it has the defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ouro_cli.settings import DEFAULTS, active_settings, executing, under

from . import attention, exact, pointwise, unique_rows
from .attention import QueryRows, SequenceLayout, attention_at_rows, dense_attention
from .config import OuroConfig
from .layers import Attend, DecoderLayer, RMSNorm, Rotary
from .matmul import linear

if TYPE_CHECKING:
    from ouro_cli.settings import ExecutionSettings


class OuroModel(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)
        self.rotary_emb = Rotary(config.dim_per_head, config.rope_theta)


class OuroForCausalLM(nn.Module):
    def __init__(self, config: OuroConfig, execution: ExecutionSettings | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = OuroModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.execution = execution or DEFAULTS

    @property
    def num_loops(self) -> int:
        return self.config.total_ut_steps

    # ---- pieces shared by every execution path -------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.rotary_emb(position_ids, dtype)

    def run_loop(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend_for_layer: Callable[[int], Attend],
    ) -> torch.Tensor:
        """One pass through the layer stack, closed by `model.norm` (the loop's exit state)."""
        with executing(self.execution):
            x = self.model.layers[0].input_layernorm(h)
            for i, (layer, closing) in enumerate(zip(self.model.layers, self.closing_norms(), strict=True)):
                h, x = layer(h, x, cos, sin, attend_for_layer(i), closing)
        return x

    def closing_norms(self) -> list[torch.Tensor]:
        """The norm weight each layer's closing kernel applies after its residual add: the next
        layer's input norm, and `model.norm` after the last layer (DecoderLayer.forward)."""
        layers = self.model.layers
        return [layer.input_layernorm.weight for layer in layers[1:]] + [self.model.norm.weight]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.lm_head.weight)

    def exit_lambda(self, h: torch.Tensor) -> torch.Tensor:
        """λ_t = sigmoid(gate(h_t)) in fp32, shape h.shape[:-1]."""
        gate = self.model.early_exit_gate
        if self.execution.exact:  # a token's exit must not depend on its batch-mates either
            return exact.exit_lambda(h, gate.weight, gate.bias)
        return torch.sigmoid(gate(h).float()).squeeze(-1)

    # ---- whole-sequence forward with per-position depths ---------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        depths: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        recompute: bool = False,
        logits_at: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_sink: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None,
        state_sink: Callable[[int, torch.Tensor], None] | None = None,
        depth_counts: LoopCounts | None = None,
    ) -> torch.Tensor:
        """input_ids [B,S] -> logits [B,S,V], or [N,V] at `logits_at` = (rows [N], cols [N]) only
        (the trainer scores response tokens: the prompt's logits are never computed).

        depths [B,S] (ints in 1..T; None = T everywhere) selects each position's loops.
        attention_mask [B,S] marks real tokens (padding on either side); document_ids
        [B,S] packs several sequences in a row (no attention across documents, RoPE
        positions restart per document). `recompute` re-runs each layer call in the
        backward pass instead of keeping its activations. `kv_sink(loop, layer, k, v)`
        receives the K/V every position holds at each (loop, layer) — its last-exited
        version — which is what the engine writes into its KV planes after prefill.
        `state_sink(loop, h)` receives the exit state `model.norm(...)` [B,S,H] every position
        holds after loop t: loop t's where it ran loop t, that of its own last loop where it
        exited before (what the exit gate reads at a position's loops 1..depth; padding holds
        anything). (`model.norm` runs fused into the last layer's closing kernel, so a module
        hook on it would never fire.) Positions of padding (`attention_mask` 0) get logits,
        K/V and states that mean nothing. Where the layer regions compile, a masked forward
        without sinks runs on a width padded to a multiple of WIDTH_ALIGN (the logits come
        back at the given width).

        The loop plan needs the depths' counts on the host (`LoopCounts`): the forward reads them
        from the device, once, unless the caller hands them in as `depth_counts`, computed with
        `LoopCounts.of` from host copies of the same `depths` and `attention_mask` (the trainer
        does, so that the read does not wait for the previous micro-batch's backward).
        """
        with executing(self.execution), attention.one_forward():
            return self._forward(
                input_ids,
                depths,
                attention_mask,
                document_ids,
                position_ids,
                recompute,
                logits_at,
                kv_sink,
                state_sink,
                depth_counts,
            )

    def _forward(
        self,
        input_ids,
        depths,
        attention_mask,
        document_ids,
        position_ids,
        recompute,
        logits_at,
        kv_sink,
        state_sink,
        depth_counts=None,
    ) -> torch.Tensor:
        width = input_ids.shape[1]
        masked = attention_mask is not None or document_ids is not None
        if masked and kv_sink is None and state_sink is None and pointwise.regions_compile(input_ids.device.type):
            input_ids, depths, attention_mask, document_ids, position_ids = _aligned_columns(
                input_ids, depths, attention_mask, document_ids, position_ids
            )
        logits = self._forward_aligned(
            input_ids,
            depths,
            attention_mask,
            document_ids,
            position_ids,
            recompute,
            logits_at,
            kv_sink,
            state_sink,
            depth_counts,
        )
        return logits if logits_at is not None else logits[:, :width]  # the padding columns cut off

    def _forward_aligned(
        self,
        input_ids,
        depths,
        attention_mask,
        document_ids,
        position_ids,
        recompute,
        logits_at,
        kv_sink,
        state_sink,
        depth_counts=None,
    ) -> torch.Tensor:
        layout = SequenceLayout.build(input_ids, attention_mask, document_ids, position_ids)
        h = self.embed(input_ids)
        cos, sin = self.rope(layout.position_ids, h.dtype)
        if depths is not None:
            depths = _check_depth_shape(depths, input_ids.shape)
        loops = _loops_to_run(depths, attention_mask, self.num_loops)
        # the forward's one read of the depths, unless the caller counted them on the host
        plan = depth_counts if depth_counts is not None else LoopCounts.read(depths, loops, self.num_loops)
        num_loops = self.num_loops if loops is None else plan.deepest
        prev_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.model.layers)
        # one compiled region per layer call of each kind (compile_layers); bound to the settings, for recompute's
        # re-run
        dense = under(pointwise.region(_layer_step, h), self.execution)
        at_rows = under(pointwise.region(_layer_step_at_rows, h), self.execution)
        for t in range(1, num_loops + 1):
            running, gathered = _loop_plan(loops, t, plan)
            if gathered:
                queries = QueryRows.build(running, layout.mask, plan.running[t - 1], plan.widest[t - 1])
                h = self._loop_at_rows(at_rows, t, h, cos, sin, queries, prev_kv, recompute, kv_sink)
            else:
                h = self._loop_dense(dense, t, h, cos, sin, layout.mask, running, prev_kv, recompute, kv_sink)
            if state_sink is not None:
                state_sink(t, h)
        if kv_sink is not None:
            for t in range(num_loops + 1, self.num_loops + 1):  # planes past everyone's depth
                for i, kv in enumerate(prev_kv):
                    kv_sink(t, i, *kv)
        return self.logits(h if logits_at is None else h[logits_at])

    def _loop_dense(self, step, t, h, cos, sin, mask, active, prev_kv, recompute, kv_sink) -> torch.Tensor:
        """Loop t on every position; where `active` [B,S] is given, only those keep the result
        (the others' K/V and hidden state stay those of their last loop)."""
        first = self.model.layers[0].input_layernorm
        x, normed = h, pointwise.rms_norm_generic(h, first.weight, first.eps)
        for i, (layer, closing) in enumerate(zip(self.model.layers, self.closing_norms(), strict=True)):
            args = (layer, mask, closing, x, normed, cos, sin, active, *(prev_kv[i] or (None, None)))
            x, normed, k, v = checkpoint(step, *args, use_reentrant=False) if recompute else step(*args)
            prev_kv[i] = (k, v)
            if kv_sink is not None:
                kv_sink(t, i, k, v)
        # `normed` is now model.norm(x): the loop's exit state
        return normed if active is None else torch.where(active[..., None], normed, h)

    def _loop_at_rows(self, step, t, h, cos, sin, queries: QueryRows, prev_kv, recompute, kv_sink) -> torch.Tensor:
        """Loop t on the positions at `queries.rows` only, gathered into one row [1,N,·]; their
        exit states are scattered back into h, every other position keeps its own."""
        b, s, hidden = h.shape
        rows = queries.rows
        # Gathered as [1, N, ·] tensors of their own, not views of [N, ·] ones: a compiled region
        # guards on whether an argument is a view, and layer 0 (handed these) would otherwise
        # compile apart from the layers after it (handed the region's own outputs).
        x = unique_rows.take(h.reshape(1, b * s, hidden), rows, queries.row_inverse, dim=1)
        cos, sin = (c.reshape(1, b * s, -1).index_select(1, rows) for c in (cos, sin))  # no gradient flows to them
        first = self.model.layers[0].input_layernorm
        normed = pointwise.rms_norm_generic(x, first.weight, first.eps)
        # Only the paged replay attention reads the layout's mask (queries.mask holds the rows'
        # part of it). Where it is not on, the step gets None for padded and unpadded layouts
        # alike: a compiled region guards on an argument's being None, and every micro-batch
        # without padding would otherwise compile a variant of its own.
        paged = active_settings().replay_attention_on(h.device.type) == "paged"
        layout_mask = queries.layout_mask if paged else None
        for i, (layer, closing) in enumerate(zip(self.model.layers, self.closing_norms(), strict=True)):
            prev_k, prev_v = prev_kv[i] or self._no_kv(h)  # only padding has run no loop before
            args = (
                layer,
                closing,
                x,
                normed,
                cos,
                sin,
                rows,
                queries.slots,
                queries.mask,
                layout_mask,
                queries.row_inverse,
                queries.slot_inverse,
                prev_k,
                prev_v,
            )
            x, normed, k, v = checkpoint(step, *args, use_reentrant=False) if recompute else step(*args)
            prev_kv[i] = (k, v)
            if kv_sink is not None:
                kv_sink(t, i, k, v)
        return unique_rows.put(h.reshape(b * s, hidden), rows, queries.row_inverse, normed[0]).view(b, s, hidden)

    def _no_kv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V a gathered loop keeps for positions that have run no loop (padding only):
        two zero tensors of their own. They require grad as every later loop's K/V does (their
        gradient is dropped), and they are not one tensor twice: a compiled region guards on
        `requires_grad` and on its arguments' aliasing, and would otherwise compile a variant
        for each micro-batch whose padding made its first loop gather."""
        c = self.config
        grad = torch.is_grad_enabled() and h.requires_grad
        return tuple(
            h.new_zeros(*h.shape[:2], c.num_key_value_heads, c.dim_per_head).requires_grad_(grad) for _ in range(2)
        )


# A loop that fewer than this share of the positions run gathers them (`_layer_step_at_rows`);
# at or above it, it runs every position and keeps only the running ones' results
# (`_layer_step`): gathering costs index copies of every activation and, in the attention, a
# mask in place of plain causality, which a few idle positions do not repay
# (why: docs/performance.md#train, measured by `bench/train_loop_work.py --sweep`).
GATHER_BELOW = 0.9


def positions_per_loop(
    depths: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    device_type: str | None = None,
    counts: LoopCounts | None = None,
) -> list[int]:
    """How many positions `forward(..., depths=depths, attention_mask=attention_mask)` runs the
    layer stack on at each loop t = 1, 2, ..., on `device_type` (default: where depths are; it
    decides whether exact mode gathers, `gathering_allowed`): its executed work is their sum ×
    the layers. `counts` are the depths' LoopCounts where the caller has them (the forward's
    `depth_counts`); else one read of the depths."""
    deepest = len(counts.running) if counts is not None else int(depths.max())
    loops = _loops_to_run(depths.long(), attention_mask, deepest)
    plan = counts if counts is not None else LoopCounts.read(None, loops, deepest)
    total = loops.numel()
    plans = (_loop_plan(loops, t, plan, device_type) for t in range(1, plan.deepest + 1))
    return [plan.running[t - 1] if gathered else total for t, (_, gathered) in enumerate(plans, 1)]


@dataclass(frozen=True)
class LoopCounts:
    """What a forward needs to know on the host about its depths, read from the device at
    once: their least and greatest (for the check), and per loop t = 1..T how many positions
    run it (`running`) and the most of them in one row (`widest`)."""

    least: int
    greatest: int
    running: list[int]
    widest: list[int]

    @property
    def deepest(self) -> int:
        """The last loop any position runs (at least 1)."""
        return max((t for t, n in enumerate(self.running, 1) if n), default=1)

    @classmethod
    def of(cls, depths: torch.Tensor | None, attention_mask: torch.Tensor | None, num_loops: int) -> LoopCounts:
        """The counts a forward of `depths` and `attention_mask` (as given to it) reads: on host
        tensors, what a caller passes as its `depth_counts`, with no device involved."""
        depths = depths.long() if depths is not None else None
        return cls.read(depths, _loops_to_run(depths, attention_mask, num_loops), num_loops)

    @classmethod
    def read(cls, depths: torch.Tensor | None, loops: torch.Tensor | None, num_loops: int) -> LoopCounts:
        parts = [] if depths is None else [depths.min().reshape(1), depths.max().reshape(1)]
        if loops is not None:
            per_row = (loops[..., None] >= torch.arange(1, num_loops + 1, device=loops.device)).sum(1)  # [B, T]
            parts += [per_row.sum(0), per_row.amax(0)]
        values = torch.cat([x.long() for x in parts]).tolist() if parts else []
        bounds, values = (values[:2], values[2:]) if depths is not None else ([1, num_loops], values)
        running, widest = (values[:num_loops], values[num_loops:]) if loops is not None else ([], [])
        counts = cls(bounds[0], bounds[1], running, widest)
        if depths is not None and (counts.least < 1 or counts.greatest > num_loops):
            raise ValueError(f"depths must lie in 1..{num_loops}, got {counts.least}..{counts.greatest}")
        return counts


def loop_gathers(running: int, total: int, *, may_gather: bool = True) -> bool:
    """Whether a loop that `running` of the `total` positions of a micro-batch tensor run gathers
    them (it then executes `running` positions) or runs all `total`; never where `may_gather`
    is False (`gathering_allowed`)."""
    return may_gather and 0 < running < GATHER_BELOW * total


def gathering_allowed(settings: ExecutionSettings, device_type: str) -> bool:
    """Whether the replay may gather a loop's running positions under `settings` on
    `device_type`. In the default mode it may. In exact mode only where its attention is the
    decode kernel (CUDA, or the Triton interpreter): a gathered query reads its own row of the
    same slot table and gets the bits it gets among all positions (kernels/replay_attention.py),
    and every other op of a loop treats rows alike (fixed-tile projections, row kernels,
    elementwise code, copies), so a gathered loop computes the dense loop's bits. Exact mode's
    torch attention (model/exact.py, CPU) has no gathered form: there every loop runs on every
    position."""
    return not settings.exact or settings.replay_attention_on(device_type) == "paged"


# Where the layer regions compile, a masked forward runs on a width that is a multiple of this
# (padded columns, masked out): inductor's SDPA lowering wants the attention bias it makes from
# the mask in rows of 8 elements and guards on whether they are, so a micro-batch of an
# unaligned width after an aligned one would compile both layer regions again. Every padded
# width passes that guard.
WIDTH_ALIGN = 8


def _aligned_columns(input_ids, depths, attention_mask, document_ids, position_ids):
    """The forward's [B, S] inputs padded on the right to a width that is a multiple of
    WIDTH_ALIGN with positions that are padding (attention_mask 0: no query reads them, their
    results are cut off or never scored). Positions of real tokens keep their indices. The
    padding runs in the loops that run every position; the trainer's work counter
    (`positions_per_loop` of the micro-batch as built) does not count it, at most
    WIDTH_ALIGN - 1 positions a row."""
    extra = -input_ids.shape[1] % WIDTH_ALIGN
    if not extra:
        return input_ids, depths, attention_mask, document_ids, position_ids
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)

    def pad(x, value):
        return None if x is None else torch.nn.functional.pad(x, (0, extra), value=value)

    return pad(input_ids, 0), pad(depths, 1), pad(attention_mask, 0), pad(document_ids, 0), pad(position_ids, 0)


def _loops_to_run(
    depths: torch.Tensor | None, attention_mask: torch.Tensor | None, num_loops: int
) -> torch.Tensor | None:
    """Loops per position [B,S]: its depth, 0 for padding (whose results nothing reads); None
    when every position runs all `num_loops`."""
    if attention_mask is None:
        return depths
    if depths is None:
        depths = torch.full(attention_mask.shape, num_loops, dtype=torch.long, device=attention_mask.device)
    return depths.masked_fill(~attention_mask.bool(), 0)


def _loop_plan(
    loops: torch.Tensor | None, t: int, counts: LoopCounts, device_type: str | None = None
) -> tuple[torch.Tensor | None, bool]:
    """How loop t runs: (positions that keep its result [B,S] or None for all, whether only they
    run it). Loop 1 runs every position unless it gathers: no position has K/V to fall back on,
    and the idle ones there are padding. `counts` holds the running positions, read before."""
    if loops is None:
        return None, False
    running = loops >= t
    n, total = counts.running[t - 1], running.numel()
    device_type = device_type or loops.device.type
    if loop_gathers(n, total, may_gather=gathering_allowed(active_settings(), device_type)):
        return running, True
    if n == total or t == 1:
        return None, False
    return running, False


def _layer_step(
    layer: DecoderLayer, mask: torch.Tensor | None, closing: torch.Tensor, x, normed, cos, sin, active, prev_k, prev_v
):
    """One layer call of a loop run on every position: mixes in last-loop K/V for positions that exited.

    A position inactive at loop t contributes the K/V it produced at its own last loop
    (`prev_k`, `prev_v` already hold that version); its own hidden state is discarded
    by the caller. Returns the layer output, its closing norm (DecoderLayer.forward) and the
    K/V actually attended to. A function of its arguments only, so that one compiled
    region serves every layer and loop (pointwise.region).
    """
    used: dict[str, torch.Tensor] = {}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if active is not None:
            keep = active[:, :, None, None]
            k, v = torch.where(keep, k, prev_k), torch.where(keep, v, prev_v)
        used["k"], used["v"] = k, v
        return dense_attention(q, k, v, mask)

    out, out_normed = layer(x, normed, cos, sin, attend, closing)
    return out, out_normed, used["k"], used["v"]


def _layer_step_at_rows(
    layer: DecoderLayer,
    closing: torch.Tensor,
    x,
    normed,
    cos,
    sin,
    rows,
    slots,
    mask,
    layout_mask,
    row_inverse,
    slot_inverse,
    prev_k,
    prev_v,
):
    """One layer call of a loop run only on the positions at `rows` (a QueryRows, field by field).

    x, normed, cos, sin [1,N,·] are theirs. Their new K/V replace theirs in copies of `prev_k`,
    `prev_v` [B,S,Hkv,D], which hold every other position's last-exited version; their queries
    attend over those copies. Returns what `_layer_step` returns, the outputs [1,N,H] for the
    running positions only and the K/V [B,S,Hkv,D] of every position. A function of its
    arguments only (pointwise.region): the token dimensions, N included, are symbolic.
    Every gather here and in the loop around it takes each position at most once, so rows
    move in and out by gathers through the inverse maps, forward and backward
    (model/unique_rows.py): no scatter, which deterministic CUDA runs through a sort.
    """
    used: dict[str, torch.Tensor] = {}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = unique_rows.put(prev_k.flatten(0, 1), rows, row_inverse, k[0]).view_as(prev_k)
        v = unique_rows.put(prev_v.flatten(0, 1), rows, row_inverse, v[0]).view_as(prev_v)
        used["k"], used["v"] = k, v
        return attention_at_rows(q, k, v, rows, slots, mask, layout_mask, slot_inverse)

    out, out_normed = layer(x, normed, cos, sin, attend, closing)
    return out, out_normed, used["k"], used["v"]


def _check_depth_shape(depths: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """depths as long, where their shape is the input's (their values: LoopCounts.read)."""
    if depths.shape != shape:
        raise ValueError(f"depths has shape {tuple(depths.shape)}, expected {tuple(shape)}")
    return depths.long()
