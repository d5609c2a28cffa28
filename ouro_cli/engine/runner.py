"""Model execution for the engine: full-depth prefill and one batched decode step.

Both run the shared model code (ouro_cli.model), so the engine and the trainer's
replay compute the same function:

- `prefill` runs the model's whole-sequence forward with per-position depths; its
  `kv_sink` hands over the K/V in the last-exited layout, scattered into the paged planes.
  A sequence recomputed after preemption is prefilled as prompt + generated tokens with
  their recorded depths, which rebuilds exactly the KV it had.
- `decode` feeds each row's newest token through loops 1..K with `model.run_loop`. A row
  that has exited keeps its hidden state and writes into plane t a copy of its previous
  plane, so planes past its depth hold the plane-e copy.

Decode batches are padded to a bucket size and attention runs in fixed chunks, so a row's
arithmetic does not depend on its batch-mates, and step shapes depend only on (bucket,
context chunks, max loops); exits are decided on the device (exits.ExitState). On CUDA the
step is captured once per shape and KV layout as a CUDA graph (CapturedDecodeStep), since
decoding is otherwise bound by kernel launches (why: docs/performance.md#decode). Eager mode
also stops early when every row has exited, its only host sync inside the step. Which
kernels run is the model's execution settings' choice (ouro_cli/settings.py:
`decode_attention`, `decode_gemv`; `attention=` overrides the first); the torch code
(paged_attention.py) stays the reference and the CPU path. With the Triton attention a
step's rows that share prompt blocks read them once per group (`cascade`, engine/cascade.py),
with the same bits. Exact mode: docs/exact.md.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ouro_cli.host_to_device import to_device
from ouro_cli.model import OuroForCausalLM, attention, exact, matmul, pointwise
from ouro_cli.model.ouro import positions_per_loop
from ouro_cli.settings import executing

from .async_exits import LaggedExitProbe
from .cascade import MIN_TILES, cascade_plan
from .exits import ExitPolicy, ExitState
from .kv_cache import PagedKVCache
from .paged_attention import decode_attention


@dataclass
class WorkCounters:
    """Layer-token evaluations: `*_layer_tokens` count work a token needed (its depth ×
    layers); `*_executed` count what ran, incl. rows kept in a batch after they exited."""

    prefill_tokens: int = 0
    prefill_tokens_shared: int = 0  # prefilled by copying an identical sequence's K/V in the same step
    prefill_layer_tokens: int = 0
    prefill_layer_tokens_executed: int = 0
    decode_tokens: int = 0
    decode_layer_tokens: int = 0
    decode_layer_tokens_executed: int = 0
    decode_steps: int = 0
    decode_steps_graphed: int = 0  # replayed from a captured CUDA graph,
    decode_steps_eager: int = 0  # or run eagerly (CPU, graphs off: the fallback)
    decode_steps_overlapped: int = 0  # queued before the previous step's tokens were read (engine overlap)
    decode_rows_discarded: int = 0  # such steps' rows for a sequence that had ended a step before
    prefill_us: int = 0  # wall time of the prefill steps, their first tokens' sampling included
    prefill_steps_graphed: int = 0  # fresh prompts prefilled by replaying a captured CUDA graph
    graph_captures: int = 0  # decode and prefill steps captured as CUDA graphs (again where the KV moved)
    graph_capture_ms: int = 0  # wall time of those captures
    # the host's waits for sampled tokens (core.finish_step)
    token_wait_us: int = 0
    # the device time of the decode steps' forwards and of their sampling (CUDA events,
    # step_timing.py): with the waits above, where a decode step's time goes
    decode_forward_gpu_us: int = 0
    decode_sample_gpu_us: int = 0
    preemptions: int = 0
    spec_draft_tokens: int = 0  # self-speculation: tokens drafted,
    spec_accepted_tokens: int = 0  # of which the target accepted,
    spec_verify_rows: int = 0  # and full-depth verification rows run (rejected ones included)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


# WorkCounters fields that measure wall time, not work: two runs of the same requests agree on the rest
TIMINGS = ("prefill_us", "graph_capture_ms", "token_wait_us", "decode_forward_gpu_us", "decode_sample_gpu_us")


@dataclass
class PrefillItem:
    tokens: list[int]
    depths: list[int]
    slots: list[int]


PADDING_POLICY = ExitPolicy.fixed(1)  # a padding row of a decode batch: one loop on the scratch slot
MAX_GEMV_ROWS = 64  # kernels/gemv.py: decode batches up to this use the small-batch matmul


# On CUDA fresh prompts up to this many tokens prefill at a bucket width, as captured graphs
# (ModelRunner.prefill); longer ones run eagerly at their own width, where the device's work
# outweighs the host's launches.
PREFILL_GRAPH_MAX = 512
KEPT_LAYOUTS = 8  # KV layouts whose captured graphs a runner keeps (ModelRunner._graphs_for_layout)
BUCKETED_PREFILL = ("cuda",)  # the device types that do (a test adds "cpu" to check the padding)


def prefill_bucket(n: int) -> int:
    """The width a fresh prompt of n <= PREFILL_GRAPH_MAX tokens prefills at on CUDA: a power of
    two, at least 16 (six graph shapes at most)."""
    return max(16, 1 << (n - 1).bit_length())


PREFILL_GROUP_TOKENS = 2048  # a prefill group's rows × width, at most (`prefill_group`)
MAX_PREFILL_GROUP = 32
MAX_PREFILL_GROUP_FP32 = 1  # fp32 prefills each prompt alone (`prefill_group` says why)


def prefill_group(width: int, dtype: torch.dtype) -> int:
    """Rows of a group of fresh prompts prefilled together at bucket `width` in `dtype`: 32 up
    to width 64, then fewer, 2,048 positions at most, so a group of one prompt and padding
    stays cheap.

    In fp32 one row: a prompt prefills alone, so its products run at the replay's shapes (a
    group's run at other cuBLAS kernels, other rounding); fp32 runs are the ones that check
    engine-trainer agreement. why: docs/performance.md#whole-update"""
    most = MAX_PREFILL_GROUP_FP32 if dtype == torch.float32 else MAX_PREFILL_GROUP
    return max(1, min(most, PREFILL_GROUP_TOKENS // width))


def batch_bucket(b: int) -> int:
    """Decode batches are padded to a power of two (at least 8): a row then meets the same
    matmul shapes whatever the number of live rows (the CUDA-graph bucket too)."""
    return max(8, 1 << (b - 1).bit_length())


class ModelRunner:
    def __init__(
        self,
        model: OuroForCausalLM,
        kv: PagedKVCache,
        counters: WorkCounters,
        attn_chunk: int = 128,
        cuda_graphs: bool = False,
        async_exits: bool = False,
        attention: str | None = None,
        cascade: bool = True,
    ) -> None:
        self.model, self.kv, self.counters = model, kv, counters
        # every decode step's rows, until LLM.take_decode_batches takes them (the newest 2^20 kept)
        self.batches: deque[int] = deque(maxlen=1 << 20)
        execution = model.execution if attention is None else replace(model.execution, decode_attention=attention)
        self.attention = execution.decode_attention_on(kv.device.type)  # "torch" | "triton" | "exact"
        # `cascade`: the Triton attention reads the prefix a step's rows share once per group
        # (engine/cascade.py), with the same bits; programs of one row would share nothing
        self.cascade_rows = 0  # rows a prefix program holds (0: no prefix pass)
        self.cascade_min_tiles = MIN_TILES  # the shortest prefix worth its pass (engine/cascade.py)
        if self.attention == "triton":
            from ouro_cli.kernels import decode_attention as triton_kernels

            self.triton_kernels = triton_kernels
            cfg = model.config
            per = triton_kernels.queries_per_program(cfg.num_attention_heads // cfg.num_key_value_heads)
            self.cascade_rows = per if cascade and per >= 2 else 0
        self.gemv = execution.decode_gemv_kernel(kv.device.type)  # the projections' small-batch kernel (None: F.linear)
        self.async_exits = async_exits  # read exit signals one loop late (async_exits.py)
        self.num_loops = model.num_loops
        self.num_layers = len(model.model.layers)
        self.attn_chunk = attn_chunk
        # the fused write-and-attend kernel takes a layer's new K/V unrounded (model/layers.py
        # `Attend`: its packed write rounds them); False has the layer round them first, as the
        # trainer's replay does (the same outputs, bit for bit)
        self.attend_packs_kv = True
        use_graphs = cuda_graphs and kv.device.type == "cuda"
        # the captured steps of the cache's current layout (None: graphs off), and those of the
        # layouts before it (`_graphs_for_layout`)
        self.graphs: dict[tuple[int, int, int, int], CapturedDecodeStep] | None = {} if use_graphs else None
        self.prefill_graphs: dict[tuple[int, int, int], CapturedPrefill] = {}
        self._layouts: OrderedDict[tuple, tuple[dict, dict]] = OrderedDict()
        self._layout: tuple | None = None
        self.graph_pool = torch.cuda.graph_pool_handle() if use_graphs else None
        # every capture runs on this one stream: the pool's freed blocks are cached per stream,
        # so one capture reuses what the captures before it freed (`capture`)
        self.capture_stream = torch.cuda.Stream(kv.device) if use_graphs else None

    def drop_graphs(self) -> None:
        """Forget every captured step; steps are captured again on first use. Their memory pool
        goes with them."""
        if self.graphs is not None:
            self.graphs, self.prefill_graphs = {}, {}
            self.graph_pool = torch.cuda.graph_pool_handle()
        self._layouts.clear()
        self._layout = None

    def close(self) -> None:
        """Drop the captured steps and their memory pool for good (graphs off from now on)."""
        self.drop_graphs()
        self.graphs, self.graph_pool = None, None

    @torch.no_grad()
    def prefill(self, item: PrefillItem) -> torch.Tensor:
        """`prefill_many([item])`: one sequence -> logits [V] at its last position."""
        return self.prefill_many([item])[0]

    @torch.no_grad()
    def prefill_many(self, items: list[PrefillItem]) -> list[torch.Tensor]:
        """Run each sequence at its depths and fill its KV planes -> logits [V] at each one's last
        position, in order.

        No two sequences share a row: packing them would change the attention reduction
        lengths, and so the rounding, of each (see paged_attention.py). A fresh prompt (depth T
        everywhere) runs without a depths tensor, so the forward plans its loops without
        reading the device. Only the last positions' logits are computed. A sequence recomputed
        with its recorded depths, or a prompt past PREFILL_GRAPH_MAX, runs alone at its own width.

        On CUDA fresh prompts of up to PREFILL_GRAPH_MAX tokens run at their bucket width
        (`prefill_bucket`; the padding after a prompt writes the scratch slot), grouped
        `prefill_group(width, dtype)` rows at a time, short groups filled with padding rows;
        with CUDA graphs on a group is one captured graph (CapturedPrefill). The rows of a group
        do not mix, so a prompt's bits are those of its width, whatever else is prefilled:
        eager or replayed, in a full group or alone."""
        device = self.kv.device
        out: list[torch.Tensor | None] = [None] * len(items)
        grouped: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            n = len(item.tokens)
            uniform = all(d == self.num_loops for d in item.depths)
            if uniform and device.type in BUCKETED_PREFILL and n <= PREFILL_GRAPH_MAX:
                grouped.setdefault(prefill_bucket(n), []).append(i)
                continue
            inputs = to_device([[item.tokens], [item.slots]], torch.long, device)
            depths = None if uniform else to_device([item.depths], torch.long, device)
            out[i] = self._prefill_body(inputs, depths, to_device([n - 1], torch.long, device))[0]
            executed = positions_per_loop(torch.tensor([item.depths]))
            self.counters.prefill_layer_tokens_executed += sum(executed) * self.num_layers
        for width, members in grouped.items():
            size = prefill_group(width, self.kv.dtype)
            for at in range(0, len(members), size):
                group = members[at : at + size]
                for i, logits in zip(group, self._prefill_group([items[i] for i in group], width, size), strict=True):
                    out[i] = logits
                self.counters.prefill_layer_tokens_executed += size * width * self.num_loops * self.num_layers
        for item in items:
            self.counters.prefill_tokens += len(item.tokens)
            self.counters.prefill_layer_tokens += sum(item.depths) * self.num_layers
        return out

    def _prefill_group(self, items: list[PrefillItem], width: int, size: int) -> torch.Tensor:
        """Fresh prompts of bucket `width` in `size` rows (rows past the prompts: padding on the
        scratch slot), replayed from the group's captured graph when graphs are on (captured on
        first use), else run eagerly. -> logits [len(items), V]."""
        scratch = self.kv.scratch_slot
        ids = [[0] * width for _ in range(size)]
        slots = [[scratch] * width for _ in range(size)]
        last = [0] * size
        for row, item in enumerate(items):
            n = len(item.tokens)
            ids[row][:n], slots[row][:n], last[row] = item.tokens, item.slots, n - 1
        device = self.kv.device
        inputs = to_device([ids, slots], torch.long, device)
        last_cols = to_device(last, torch.long, device)
        if self.graphs is None:
            logits = self._prefill_body(inputs, None, last_cols)
        else:
            self._graphs_for_layout()
            graph = self._captured(
                self.prefill_graphs, (width, size, self.kv.planes), lambda: CapturedPrefill(self, width, size)
            )
            self.counters.prefill_steps_graphed += len(items)
            logits = graph.run(inputs, last_cols)
        return logits[: len(items)]

    def _graphs_for_layout(self) -> None:
        """Make `graphs` and `prefill_graphs` those captured on the cache's current layout
        (kv_cache.PagedKVCache.layout), keeping the last KEPT_LAYOUTS layouts' graphs for
        when a layout comes back (kv_memory.ReservedBuffer). Where the address moves, no
        layout comes back: every earlier graph is dropped."""
        layout = self.kv.layout
        if layout == self._layout:
            return
        if not self.kv.fixed_address:
            self.drop_graphs()
        tables = self._layouts.pop(layout, None) or ({}, {})
        self._layouts[layout] = tables
        while len(self._layouts) > KEPT_LAYOUTS:
            self._layouts.popitem(last=False)
        self.graphs, self.prefill_graphs = tables
        self._layout = layout

    def _captured(self, table: dict, key: tuple, capture_step: Callable[[], Any]) -> Any:
        """`table[key]`, captured by `capture_step()` on first use (counted and timed)."""
        if key not in table:
            start = time.perf_counter()
            table[key] = capture_step()
            self.counters.graph_captures += 1
            self.counters.graph_capture_ms += round((time.perf_counter() - start) * 1e3)
        return table[key]

    def _prefill_body(self, inputs: torch.Tensor, depths: torch.Tensor | None, last: torch.Tensor) -> torch.Tensor:
        """The prefill forward of R sequences, one per row: `inputs` [2, R, W] the token ids and
        their KV slots, `depths` [R, W] or None (T everywhere), `last` [R] each row's column whose
        logits come back [R, V]."""
        slots = inputs[1].flatten()

        def sink(loop: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            if loop <= self.kv.planes:  # deeper planes are never read at this view's budget
                self.kv.write(layer, loop - 1, slots, k.flatten(0, 1), v.flatten(0, 1))

        rows = torch.arange(last.shape[0], device=last.device)
        with pointwise.eager():  # host-bound: compiled calls would cost more than they save here
            return self.model(inputs[0], depths=depths, kv_sink=sink, logits_at=(rows, last))

    @torch.no_grad()
    def decode(
        self,
        tokens: list[int] | tuple[torch.Tensor, list[int]],
        positions: list[int],
        block_tables: list[list[int]],
        policies: list[ExitPolicy],
        reach: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row at `positions` (= cached length) -> (logits [B, V], depths [B]).

        `tokens` are the input ids, or (ids on the device, row of each input in them): the
        previous step's sampled tokens, never read back to the host. `reach` is the longest
        context any row may come to hold (0: unknown); with the Triton attention, whose bits
        do not depend on the width, the step's width covers it from the first step, so one
        captured graph per batch bucket serves a whole rollout."""
        b = len(positions)
        pad = batch_bucket(b) - b  # padding rows: token 0 at position 0 in the scratch slot, one loop
        policies = policies + [PADDING_POLICY] * pad
        host_ids = tokens if isinstance(tokens, list) else [0] * b
        longest = max(positions) + 1
        if self.attention == "triton":
            longest = max(longest, reach)
        inputs = self._inputs(host_ids + [0] * pad, positions + [0] * pad, block_tables + [[]] * pad, policies, longest)
        if not isinstance(tokens, list):
            ids, rows = tokens
            inputs.ints[:b, DecodeInputs.IDS] = ids[to_device(rows, torch.long, ids.device)]
        max_loops = max(p.stop_after for p in policies)
        if max_loops > self.kv.planes:
            raise RuntimeError(f"a decode row runs {max_loops} loops but the KV cache holds {self.kv.planes} planes")
        if self.graphs is not None:
            self._graphs_for_layout()
            # planes: the cache's current view; a step with a prefix pass is a graph of its own
            key = (b + pad, inputs.width, max_loops, self.kv.planes, inputs.cascade)
            step = self._captured(self.graphs, key, lambda: CapturedDecodeStep(self, *key[:3], cascade=key[4]))
            logits, depth = step.run(inputs)
            loops_run = max_loops
            self.counters.decode_steps_graphed += 1
        else:
            exits = inputs.exit_state(max_loops, may_exit_early=any(math.isfinite(p.tau) for p in policies))
            logits, depth, loops_run = self._step(inputs, exits, allow_sync=True)
            self.counters.decode_steps_eager += 1
        self.counters.decode_tokens += b
        self.counters.decode_steps += 1
        self.batches.append(b)
        self.counters.decode_layer_tokens_executed += (b + pad) * loops_run * self.num_layers
        return logits[:b], depth[:b]

    def _inputs(
        self,
        tokens: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        policies: list[ExitPolicy],
        longest: int,
    ) -> DecodeInputs:
        """The step's host inputs packed into two tensors: one host-to-device copy each (and
        one copy each into a captured graph's inputs), whatever the batch size; the context
        width covers `longest` positions."""
        chunks = -(-longest // self.attn_chunk)
        if self.graphs is not None:  # a power of two of chunks: few graph shapes (extra chunks are no-ops)
            chunks = 1 << (chunks - 1).bit_length()
        width = chunks * self.attn_chunk
        nb = -(-width // self.kv.block_size)
        # filled row by row in numpy, cheaper on the host than one flat Python list
        ints = np.full((len(tokens), DecodeInputs.TABLE + nb), self.kv.num_blocks, dtype=np.int64)  # scratch block
        ints[:, : DecodeInputs.CASCADE] = [
            (token, pos, stop, lo, delay)
            for token, pos, (stop, lo, _tau, delay) in zip(tokens, positions, policies, strict=True)
        ]
        for row, table in zip(ints, block_tables, strict=True):
            n = min(len(table), nb)
            row[DecodeInputs.TABLE : DecodeInputs.TABLE + n] = table[:n]
        ints[:, DecodeInputs.CASCADE : DecodeInputs.TABLE] = 0
        if self.cascade_rows:  # the rows' shared prefixes: one read per group (engine/cascade.py)
            plan = cascade_plan(
                ints[:, DecodeInputs.TABLE :],
                ints[:, DecodeInputs.POS],
                self.kv.block_size,
                self.triton_kernels.BLOCK,
                self.cascade_rows,
                self.cascade_min_tiles,
            )
            ints[:, DecodeInputs.CASCADE : DecodeInputs.TABLE] = plan.T
        device = self.kv.device
        return DecodeInputs(
            ints=to_device(torch.from_numpy(ints), torch.long, device),
            tau=to_device([p.tau for p in policies], torch.float32, device),
            width=width,
            cascade=bool(self.cascade_rows) and bool(ints[:, DecodeInputs.CASCADE].any()),
        )

    def _step(self, inputs: DecodeInputs, exits: ExitState, allow_sync: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The decode step on padded device inputs -> (logits [B, V], depths [B], loops run).

        Without `allow_sync` it never reads the device from the host (CUDA-graph capture)."""
        with matmul.use_small_batch(self.gemv, MAX_GEMV_ROWS), executing(self.model.execution):
            return self._step_body(inputs, exits, allow_sync)

    def _step_body(
        self, inputs: DecodeInputs, exits: ExitState, allow_sync: bool
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        model, kv = self.model, self.kv
        pos = inputs.column(DecodeInputs.POS)[:, None]
        lengths = pos[:, 0] + 1  # `valid` is exactly the first `lengths` positions (kv.slot_table)
        ctx_slots, valid = kv.slot_table(inputs.ints[:, DecodeInputs.TABLE :], lengths, inputs.width)
        new_slots = ctx_slots.gather(1, pos).squeeze(1)
        h = model.embed(inputs.column(DecodeInputs.IDS)[:, None])
        cos, sin = model.rope(pos, h.dtype)
        plane = 0
        if self.attention == "triton":
            ops = self.triton_kernels
        cascade = self._cascade(inputs) if inputs.cascade else None

        def attend_for_layer(layer: int):
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                k, v = k[:, 0], v[:, 0]
                if self.attention == "triton":  # the write and the attention in one kernel (fp8: packed there)
                    k_plane, v_plane = kv.plane(layer, plane)
                    prev = kv.plane(layer, plane - 1) if plane > 0 else (None, None)
                    return ops.write_kv_and_attend(
                        q[:, 0],
                        k_plane,
                        v_plane,
                        *prev,
                        new_slots,
                        k,
                        v,
                        exits.active,
                        ctx_slots,
                        lengths,
                        cascade=cascade,
                    )[:, None]
                if plane > 0:  # exited rows carry their last plane forward instead of new K/V
                    keep = exits.active[:, None, None]
                    k_prev, v_prev = kv.read(layer, plane - 1, new_slots)
                    k, v = torch.where(keep, k, k_prev), torch.where(keep, v, v_prev)
                kv.write(layer, plane, new_slots, k, v)
                if self.attention == "exact":  # the replay's chunk order (model/exact.py)
                    o = exact.paged_attention(q[:, 0], *kv.plane(layer, plane), ctx_slots, valid)
                else:
                    o = decode_attention(q[:, 0], *kv.plane(layer, plane), ctx_slots, valid, self.attn_chunk)
                return o[:, None]

            attend.packs_kv = self.attention == "triton" and self.attend_packs_kv
            return attend

        loops_run = 0
        probe = LaggedExitProbe() if self.async_exits and allow_sync and exits.may_exit_early else None
        for t in range(1, exits.max_loops + 1):
            plane = t - 1
            x = model.run_loop(h, cos, sin, attend_for_layer)
            h = torch.where(exits.active[:, None, None], x, h)
            exits.after_loop(t, model.exit_lambda(x[:, 0]))
            loops_run = t
            if probe is not None:  # loop t is queued; only now read what loop t-1 decided
                if t < exits.max_loops and probe.everyone_done():
                    break
                probe.record(exits, t)
            elif allow_sync and exits.may_exit_early and t < exits.max_loops and not bool(exits.active.any()):
                break  # everyone exited: skip the loops nobody needs
        kv.copy_forward(new_slots, loops_run - 1)
        return model.logits(h[:, 0]), exits.depth, loops_run

    def _cascade(self, inputs: DecodeInputs):
        """The step's prefix-pass tables (`DecodeInputs.CASCADE`) and one scratch for every layer
        and loop of the step (each attention call writes it before it reads it)."""
        cfg = self.model.config
        plan = inputs.ints[:, DecodeInputs.CASCADE : DecodeInputs.TABLE].T
        return self.triton_kernels.Cascade.from_plan(plan, cfg.num_attention_heads, cfg.dim_per_head)


@dataclass
class DecodeInputs:
    """Device inputs of one padded decode step (a captured graph keeps one static copy).

    `ints` [B, TABLE + blocks]: per row the input token, its position (= cached length),
    its exit policy (stop after, min loops, delay), four columns of the cascade pass's
    tables (engine/cascade.py's plan, one table a column; zeros without a prefix pass) and
    its block table padded with the scratch block; `tau` [B] the exit thresholds; `width` the
    attended context length; `cascade` whether the step runs the prefix pass (some row has
    prefix tiles: a step without one launches no prefix kernels)."""

    IDS, POS, STOP_AFTER, MIN_LOOPS, DELAY, CASCADE = range(6)
    TABLE = CASCADE + 4

    ints: torch.Tensor
    tau: torch.Tensor
    width: int
    cascade: bool = False

    def column(self, i: int) -> torch.Tensor:
        return self.ints[:, i]

    def exit_state(self, max_loops: int, may_exit_early: bool) -> ExitState:
        return ExitState.start(
            self.column(self.STOP_AFTER),
            self.column(self.MIN_LOOPS),
            self.tau,
            self.column(self.DELAY),
            max_loops=max_loops,
            may_exit_early=may_exit_early,
        )


class CapturedDecodeStep:
    """One decode step captured as a CUDA graph for (bucket, context width, max loops, KV planes,
    prefix pass or not).

    It runs all `max_loops` loops (exited rows are masked, as in eager mode, so results are
    identical). Warm-up and capture point every row at the scratch slot, so they never touch
    a live sequence's KV. Parameters and KV planes are updated in place, so the graph stays
    valid across weight publication and across a release of the cache that brings back its
    layout. Outputs live in the graph's memory: the caller consumes them before the next
    replay of any graph.
    """

    def __init__(self, runner: ModelRunner, batch: int, width: int, max_loops: int, cascade: bool = False) -> None:
        kv = runner.kv
        device = kv.device
        ints = torch.zeros(batch, DecodeInputs.TABLE + -(-width // kv.block_size), dtype=torch.long, device=device)
        ints[:, DecodeInputs.STOP_AFTER] = max_loops
        ints[:, DecodeInputs.MIN_LOOPS] = 1
        ints[:, DecodeInputs.TABLE :] = kv.num_blocks  # position 0 of the scratch block: the scratch slot
        tau = torch.full((batch,), float("inf"), device=device)
        # the prefix tables hold zeros (no prefix) at capture; each replay copies the step's in
        self.inputs = DecodeInputs(ints=ints, tau=tau, width=width, cascade=cascade)

        def body():
            exits = self.inputs.exit_state(max_loops, may_exit_early=False)
            logits, depth, _ = runner._step(self.inputs, exits, allow_sync=False)
            return logits, depth

        self.graph, (self.logits, self.depth) = capture(body, runner.graph_pool, runner.capture_stream)

    def run(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        self.inputs.ints.copy_(inputs.ints)
        self.inputs.tau.copy_(inputs.tau)
        with torch.cuda.device(self.inputs.ints.device):  # replay launches on the current device's stream
            self.graph.replay()
        return self.logits, self.depth


class CapturedPrefill:
    """A group of fresh prompts' prefill at one bucket width, captured as a CUDA graph for
    (width, rows, KV planes); valid across weight publication like CapturedDecodeStep.

    Inputs: token ids and KV slots [2, rows, width] and each row's last column; warm-up and
    capture point every slot at the scratch slot. `run` returns a copy of the logits
    [rows, V]: a step prefills many groups before it samples."""

    def __init__(self, runner: ModelRunner, width: int, rows: int) -> None:
        kv = runner.kv
        self.inputs = torch.full((2, rows, width), kv.scratch_slot, dtype=torch.long, device=kv.device)
        self.inputs[0] = 0
        self.last = torch.zeros(rows, dtype=torch.long, device=kv.device)
        self.graph, self.logits = capture(
            lambda: runner._prefill_body(self.inputs, None, self.last), runner.graph_pool, runner.capture_stream
        )

    def run(self, inputs: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        self.inputs.copy_(inputs)
        self.last.copy_(last)
        with torch.cuda.device(self.inputs.device):
            self.graph.replay()
        return self.logits.clone()


def capture(body, pool, stream: torch.cuda.Stream):
    """Run `body` once to warm up, then capture it as a CUDA graph in `pool` -> (graph, its outputs).

    Both run on `stream`, the runner's one capture stream on the engine's own device
    (`torch.cuda.graph`'s default capture stream is made on whichever device was current at its
    first use, which may not be ours). The allocator caches a pool's freed blocks per stream:
    captured on one stream, every graph of the pool reuses the memory that the captures before
    it freed, and the pool holds one capture's transient memory beside the graphs' outputs,
    not one per stream."""
    device = stream.device
    with torch.cuda.device(device), attention.tables_kept() as tables:
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            body()  # warm-up outside capture (lazy inits, autotuning, the replay attention's tables)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outputs = body()
    graph.kept_tables = tables  # the graph reads them at every replay (model/attention.py tables_kept)
    return graph, outputs
