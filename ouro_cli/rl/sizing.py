"""How a colocated run divides its memory: KV cache, sequences in flight, micro-batch tokens.

A run may fill `gpu_memory_utilization` × the device's memory (host memory on CPU).
Part of it is resident the whole time: the trainer's weights, fp32 main weights and Adam
moments (the optimizer state, unless it goes to the host: below), the engine's copy of
the weights, on CUDA the engine's CUDA-graph pool, and a runtime reserve (CUDA context,
library workspaces, allocator slack). On CUDA the budget is also the allocator's cap
(rl/allocator.py), so what the process holds, not only what its tensors take, stays within it.
The rest is used in turns: during a rollout by the engine's paged KV cache, during a
train step by the trainer's activations and its fp32 gradients, because the engine hands
its cache back while the trainer steps (`engine.contract.ReleasesMemory`) and the trainer
frees its gradients after each step (`Trainer.release_gradients`: they are dead until the
next backward). An engine that cannot hand its cache back (the PD engine, an external
factory) keeps it; the cache then gets at most half of that memory, the trainer the rest,
and the gradients stay resident.

`--offload-optimizer auto` moves the optimizer state to the host when, on a GPU, the cache
could not otherwise hold every sequence of a rollout at the deepest K (sequences that do
not fit wait for a free slot, are preempted and recomputed, and decode in a second, thin
wave; docs/memory.md §1). Beside an engine that hands its cache back, the state then
leaves the device only for the generate calls that need its room (`RunSizing.state_fits`;
a released cache comes back only as large as the call needs), and the micro-batches are
sized with the state on the device. `on` keeps it on the host between every two steps.

Every figure here is computed from the model's shape, the dtypes and the device's total
memory, never from the momentary free memory: a run and its resumption in a fresh
process size themselves the same way, and the sizes are recorded in the run's plan
(they decide batch composition and micro-batch splits, so they change numerics).
`check_fits` then compares the plan with what the device really has free, once. Host
memory is shared with everything else on the machine, so on CPU the budget is taken
from the memory available at the start, rounded down to whole GiB (a resumed run reuses
the recorded plan either way).

The activation model counts what the replay keeps for backward per token and layer call
at full depth T (the prompt runs T loops, so every micro-batch runs T loops): the saved
inputs of the projections, q/k/v and the attention output, and the MLP's gate, up and
product. Recompute keeps only each layer call's inputs and re-runs one call at a time.
The coefficients are upper bounds of the measured peaks (`bench/e2e.py` prints them
side by side; docs/memory.md §3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ouro_cli.errors import ResourceError, UserError
from ouro_cli.model import kv_quant
from ouro_cli.model.config import OuroConfig

GIB = 2**30

# Per layer call and token, in activation-dtype elements: saved for backward without
# recompute (hidden-size vectors, plus gate, up and their product), and with it (the
# call's inputs). Upper bounds of bench/train_memory.py's peaks (docs/memory.md §3).
SAVED_HIDDEN_VECTORS = 9
SAVED_INTERMEDIATE_VECTORS = 3
# Exact mode (`--exact`) runs eager: its norms and SwiGLU keep only their inputs and re-run in
# backward (model/exact.py), the rest keeps what eager autograd keeps. Counted with saved-tensor
# hooks on CPU (the exact path is the same code on CPU and CUDA but for the projections' and the
# attention's kernels, whose saved inputs match), with a margin above the count, as the
# default's have above its peak (bench/train_memory.py --exact; docs/memory.md §3).
EXACT_SAVED_HIDDEN_VECTORS = 11
EXACT_SAVED_INTERMEDIATE_VECTORS = 4
RECOMPUTE_HIDDEN_VECTORS = 3
# Per scored token and vocabulary entry: the logits and their gradient in the model's
# dtype, plus fp32 copies (upcast, / temperature, log-softmax kept for backward, the
# entropy's probabilities, two gradients).
LOGIT_FP32_COPIES = 5
# Runtime reserve: CUDA context, cuBLAS/cuDNN workspaces, compiled-kernel scratch; and the
# fraction of the budget left as allocator slack (fragmentation between the two phases).
CUDA_RUNTIME_RESERVE = 3 * GIB
# The engine's CUDA-graph memory pool (engine/runner.py `capture`): the captured steps' outputs
# and one capture's transient memory, held for the whole run. An upper bound of the pools
# bench/shapes.py measures (`graph_pools_gib`), which grow with the layers a step runs through.
GRAPH_POOL_BASE = GIB
GRAPH_POOL_PER_LAYER = 32 * 2**20
CPU_RUNTIME_RESERVE = GIB // 2
SLACK_FRACTION = 0.05
# Below this many tokens per micro-batch the GEMMs stop filling the GPU: recompute then buys
# larger micro-batches for about a third more compute.
MIN_EFFICIENT_MICRO_BATCH = 8192
MAX_DEFAULT_SEQS = 512  # decode batches beyond this gain nothing and lengthen graph capture
TOKEN_ALIGN = 128


@dataclass(frozen=True)
class DeviceMemory:
    """The memory of the device a run uses: CUDA device memory, or host RAM on CPU."""

    kind: str  # "cuda" | "cpu"
    total: int
    free: int

    @classmethod
    def of(cls, device: torch.device) -> DeviceMemory:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return cls("cuda", int(total), int(free))
        import psutil

        vm = psutil.virtual_memory()
        return cls("cpu", int(vm.total), int(vm.available))


def parameter_counts(config: OuroConfig) -> tuple[int, int]:
    """(all parameters, trainable ones): the exit gate is frozen in GRPO."""
    h, i, d = config.hidden_size, config.intermediate_size, config.dim_per_head
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    layer = attn + 3 * h * i + 4 * h
    gate = h + 1
    total = 2 * config.vocab_size * h + config.num_hidden_layers * layer + h + gate
    return total, total - gate


def kv_bytes_per_token(config: OuroConfig, dtype: torch.dtype, planes: int, fp8_kv: bool = False) -> int:
    """K and V of one cached token over all layers and `planes` loop planes: in the model's
    `dtype`, or with `fp8_kv` packed, head_dim fp8 bytes and a scale byte per head
    (model/kv_quant.py)."""
    row = kv_quant.row_bytes(config.dim_per_head, dtype.itemsize, fp8_kv)
    return 2 * config.num_hidden_layers * planes * config.num_key_value_heads * row


def _per_call(config: OuroConfig, exact: bool) -> int:
    """Activation-dtype elements one layer call keeps per position for backward, without recompute."""
    h, i = config.hidden_size, config.intermediate_size
    if exact:
        return EXACT_SAVED_HIDDEN_VECTORS * h + EXACT_SAVED_INTERMEDIATE_VECTORS * i
    return SAVED_HIDDEN_VECTORS * h + SAVED_INTERMEDIATE_VECTORS * i


def activation_bytes_per_token(
    config: OuroConfig, dtype: torch.dtype, recompute: bool, row_width: int, exact: bool = False
) -> int:
    """What one position of a micro-batch costs the replay's forward + backward (module docstring),
    in exact mode (`exact`) or not."""
    h, calls = config.hidden_size, config.num_hidden_layers * config.num_loops
    if recompute:  # the inputs of every call, and one call re-run at a time
        kept = calls * RECOMPUTE_HIDDEN_VECTORS * h + _per_call(config, exact)
    else:
        kept = calls * _per_call(config, exact)
    mask = 6 * row_width  # a packed row's document mask and the attention bias made from it
    logits = config.vocab_size * (2 * dtype.itemsize + 4 * LOGIT_FP32_COPIES)
    return kept * dtype.itemsize + logits + mask


def token_cost_shares(config: OuroConfig, recompute: bool, exact: bool = False) -> dict[str, float]:
    """The activation model's `trainer.batching.TokenCost` shares: what one loop of a position keeps
    (a layer call per layer), and, of that, what a position that sits out a gathering loop still
    holds (its K/V in the full copy the gathered queries attend over), over what a full-depth
    position keeps (`activation_bytes_per_token` without its row-width mask term: the shares
    are per position, the mask's cost stays in the rest)."""
    per_call = RECOMPUTE_HIDDEN_VECTORS * config.hidden_size if recompute else _per_call(config, exact)
    full = activation_bytes_per_token(
        config, torch.bfloat16, recompute, 0, exact
    )  # the shares do not depend on the dtype
    loop = config.num_hidden_layers * per_call * torch.bfloat16.itemsize
    kv = 2 * config.num_key_value_heads * config.dim_per_head
    return {"loop": loop / full, "idle": min(1.0, kv / per_call)}


def graph_pool_bytes(config: OuroConfig) -> int:
    """What the engine's CUDA-graph pool may hold (GRAPH_POOL_BASE's comment)."""
    return GRAPH_POOL_BASE + GRAPH_POOL_PER_LAYER * config.num_hidden_layers


def gradient_bytes(config: OuroConfig) -> int:
    """Megatron's fp32 grad buffer."""
    return parameter_counts(config)[1] * 4


def resident_bytes(
    config: OuroConfig,
    dtype: torch.dtype,
    *,
    kind: str,
    offload_optimizer: bool,
    optimizer_shards: int = 1,
    gradients_released: bool = False,
) -> dict[str, int]:
    """What stays allocated for the whole run, by part (the gradients not, where they are
    released between updates)."""
    total, trainable = parameter_counts(config)
    mixed = dtype != torch.float32  # bf16 params: fp32 main weights in the optimizer
    optimizer = trainable * 4 * (2 + (1 if mixed else 0)) // optimizer_shards
    return {
        "trainer_weights": total * dtype.itemsize,
        "gradients": 0 if gradients_released else gradient_bytes(config),
        "optimizer": 0 if offload_optimizer else optimizer,
        "engine_weights": total * dtype.itemsize,
        "runtime": CUDA_RUNTIME_RESERVE if kind == "cuda" else CPU_RUNTIME_RESERVE,
        "engine_graphs": graph_pool_bytes(config) if kind == "cuda" else 0,
    }


@dataclass
class RunSizing:
    """The memory plan of a run (recorded in ouro-plan.json)."""

    budget_bytes: int
    resident_bytes: int
    kv_blocks: int  # at T planes, blocks of `block_size` tokens (the engine's unit)
    kv_bytes: int
    max_num_seqs: int
    max_tokens_per_micro_batch: int
    recompute: bool
    engine_releases_memory: bool
    offload_optimizer: bool = False
    gradients_released: bool = False  # the trainer frees its grad buffer after each step
    # --offload-optimizer auto, on: the state stays on the device, and the micro-batches leave
    # room for it, except during a generate call whose cache does not fit beside it
    # (`state_fits`); a plain "on" keeps it on the host between steps
    state_per_call: bool = False
    kv_room_beside_state: int = 0  # the cache a call may allocate with the state on the device
    # the micro-batch budget in full-depth positions (`token_cost_shares`); None: every position counts
    # as one (a budget given by the user)
    token_cost: dict[str, float] | None = None
    # fixed-budget samples train as a body and a prompt head (trainer.batching.split_prompts):
    # how the update is cut into micro-batches, so recorded with them
    prompt_heads: bool = False
    # ... and the samples left whole and the heads come before the bodies (split_prompts
    # `deep_first`): the same loss, cut into other micro-batches
    deep_parts_first: bool = False

    def state_fits(self, call_kv_bytes: int) -> bool:
        """Whether a generate call whose cache takes `call_kv_bytes` (module function
        `call_kv_bytes`) runs with the optimizer state left on the device."""
        return self.state_per_call and call_kv_bytes <= self.kv_room_beside_state

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def tokens_at(self, planes: int, config: OuroConfig, block_size: int) -> int:
        """KV tokens the cache holds when viewed with `planes` planes."""
        return (self.kv_blocks + 1) * block_size * config.num_loops // planes - block_size


@dataclass(frozen=True)
class CallShape:
    """One kind of generate call a run makes: `sequences` requests on `prompts` distinct prompts
    (a rollout: its samples on its prompts, a group's samples on one; an evaluation: its
    prompts x samples). The engine holds a group's full prompt blocks once
    (`engine.kv_cache.most_call_blocks`)."""

    sequences: int
    prompts: int


def call_blocks(
    call: CallShape, *, block_size: int, seq_tokens: int, prompt_tokens: int | None, draft_tokens: int = 0
) -> int:
    """The most KV blocks the engine holds at once for `call`, its prompts of at most `prompt_tokens`
    tokens and its sequences of at most `seq_tokens` (prompt + max_tokens): a group's full prompt
    blocks once and every request's own blocks (`engine.kv_cache.most_call_blocks`). `prompt_tokens`
    None: every request counted with a prompt of its own (`engine.kv_cache.request_blocks`)."""
    from ouro_cli.engine.kv_cache import most_call_blocks, request_blocks  # only when a run asks

    if prompt_tokens is None:
        return call.sequences * request_blocks(seq_tokens - 1, draft_tokens, block_size)
    return most_call_blocks(
        call.sequences, call.prompts, prompt_tokens, seq_tokens - prompt_tokens, draft_tokens, block_size
    )


def call_kv_bytes(
    config: OuroConfig,
    dtype: torch.dtype,
    *,
    block_size: int,
    planes: int,
    sequences: int,
    seq_tokens: int,
    kv_blocks: int | None,
    draft_tokens: int = 0,
    prompts: int | None = None,
    prompt_tokens: int | None = None,
    fp8_kv: bool = False,
) -> int:
    """The most a released cache of `kv_blocks` blocks (at T planes) allocates for one generate
    call of `sequences` requests on `prompts` distinct prompts (None: as many as requests) of at
    most `prompt_tokens` tokens, each of at most `seq_tokens` tokens (prompt + max_tokens), at
    `planes` planes: the engine's count (`call_blocks`; `prompt_tokens` None: every request with a
    prompt of its own), rounded up as `restore_blocks` rounds it for that cache, and the scratch
    block. `kv_blocks` None: the count before rounding, for a cache not yet sized."""
    from ouro_cli.engine.kv_cache import capacity_blocks, restore_blocks  # only when a run asks

    call = CallShape(sequences, sequences if prompts is None else prompts)
    blocks = call_blocks(
        call, block_size=block_size, seq_tokens=seq_tokens, prompt_tokens=prompt_tokens, draft_tokens=draft_tokens
    )
    if kv_blocks is not None:
        blocks = restore_blocks(blocks, capacity_blocks(kv_blocks, config.num_loops, planes, block_size))
    blocks += 1
    return blocks * block_size * kv_bytes_per_token(config, dtype, planes, fp8_kv)


def size_run(
    config: OuroConfig,
    memory: DeviceMemory,
    *,
    utilization: float,
    dtype: torch.dtype,
    block_size: int,
    seq_tokens: int,
    sequences_needed: int,
    tokens_per_update: int,
    planes: int,
    engine_releases_memory: bool,
    offload_optimizer: str | bool = "off",
    optimizer_shards: int = 1,
    kv_blocks: int | None = None,
    max_num_seqs: int | None = None,
    max_tokens_per_micro_batch: int | None = None,
    recompute: str = "auto",
    token_cost: dict[str, float] | None | str = "auto",
    prompt_heads: bool = True,
    deep_parts_first: bool = True,
    exact: bool = False,
    prompt_tokens: int | None = None,
    calls: Sequence[CallShape] = (),
    fp8_kv: bool = False,
) -> RunSizing:
    """Size the KV cache, the decode batch and the micro-batches for one run.

    `seq_tokens`: the longest prompt + `--max-response-len` (one sequence's KV, one sample's
    replay); `sequences_needed`: the most sequences one generate call submits (a rollout's
    samples, or an evaluation's prompts); `tokens_per_update`: this rank's replay tokens at
    most; `planes`: the deepest budget the run decodes at (T with speculation).
    The cache is sized for the largest call at the deepest budget: with `prompt_tokens` (the
    longest prompt; `seq_tokens` less it is the response) the largest of `calls` (default: one of
    `sequences_needed` distinct prompts), a group's full prompt blocks counted once
    (`call_blocks`); without it, `sequences_needed` sequences of `seq_tokens` tokens each.
    Explicit `kv_blocks`, `max_num_seqs` and `max_tokens_per_micro_batch` win. `token_cost`
    "auto": a budget sized here counts full-depth positions (`token_cost_shares`), a given one plain
    positions; a resumed run passes the one its plan recorded, and its `prompt_heads` and
    `deep_parts_first`.
    `offload_optimizer` "auto" is decided from the shapes alone (module docstring), so a
    resumed run decides it the same way. `exact`: the trainer replays in exact mode, whose
    activations are counted apart (`activation_bytes_per_token`). `fp8_kv`: the cache holds
    packed fp8 K/V (`kv_bytes_per_token`).
    """
    if not 0 < utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must lie in (0, 1], got {utilization}")
    if recompute not in ("auto", "on", "off"):
        raise UserError(f"--recompute must be auto, on or off, got {recompute!r}")
    offload_optimizer = {True: "on", False: "off"}.get(offload_optimizer, offload_optimizer)
    if offload_optimizer not in ("auto", "on", "off"):
        raise UserError(f"--offload-optimizer must be auto, on or off, got {offload_optimizer!r}")
    budget = int(utilization * (memory.total if memory.kind == "cuda" else min(memory.total, memory.free // GIB * GIB)))
    per_token_t = kv_bytes_per_token(config, dtype, config.num_loops, fp8_kv)
    block_bytes = per_token_t * block_size
    per_token = kv_bytes_per_token(config, dtype, planes, fp8_kv)
    seq_blocks = math.ceil(seq_tokens / block_size)
    if prompt_tokens is None:
        needed_blocks = sequences_needed * seq_blocks
    else:  # every sequence of the largest call at the deepest K, a group's prompt once
        shapes = calls or (CallShape(sequences_needed, sequences_needed),)
        needed_blocks = max(
            call_blocks(c, block_size=block_size, seq_tokens=seq_tokens, prompt_tokens=prompt_tokens) for c in shapes
        )
    needed = needed_blocks * block_size * per_token

    released = engine_releases_memory  # beside a cache that stays, freeing the gradients buys nothing
    grads = gradient_bytes(config) if released else 0  # taken in turns, in the train phase

    def room(offload: bool) -> int:  # what the KV cache and the activations take in turns
        parts = resident_bytes(
            config,
            dtype,
            kind=memory.kind,
            offload_optimizer=offload,
            optimizer_shards=optimizer_shards,
            gradients_released=released,
        )
        return budget - sum(parts.values()) - int(SLACK_FRACTION * budget)

    if offload_optimizer == "auto":  # on where the cache the run wants does not fit beside the state
        wanted = needed + block_bytes if kv_blocks is None else (kv_blocks + 1) * block_bytes
        kv_room = room(False) if engine_releases_memory else room(False) // 2
        offload_optimizer = "on" if memory.kind == "cuda" and kv_room < wanted else "off"
        # where the cache hands its memory back, the state leaves only for the calls that need its room
        per_call = offload_optimizer == "on" and engine_releases_memory
    else:
        per_call = False
    offloads = offload_optimizer == "on"
    state = resident_bytes(config, dtype, kind=memory.kind, offload_optimizer=False, optimizer_shards=optimizer_shards)[
        "optimizer"
    ]
    turns = room(offloads)
    resident = budget - turns
    what = "GPU" if memory.kind == "cuda" else "host"
    if turns - grads <= 0:
        raise ResourceError(
            f"the model does not fit: weights, gradients and optimizer state need {(resident + grads) / GIB:.1f} GiB, "
            "more than "
            f"--gpu-memory-utilization {utilization} of {memory.total / GIB:.1f} GiB of {what} memory; raise it or "
            f"pass "
            "--offload-optimizer on"
        )

    given = kv_blocks is not None
    if kv_blocks is None:
        # enough for every sequence a call submits at the deepest budget, and no more than fits
        kv_bytes = min(turns if engine_releases_memory else turns // 2, needed + block_bytes)
        kv_blocks = kv_bytes // block_bytes - 1
    kv_bytes = (kv_blocks + 1) * block_bytes
    fits = ((kv_blocks + 1) * block_size * config.num_loops // planes - block_size) // (seq_blocks * block_size)
    if fits < 1 and given:
        raise ResourceError(
            f"--kv-blocks {kv_blocks} holds {(kv_blocks + 1) * block_size * config.num_loops // planes - block_size} "
            f"tokens at {planes} planes, but one sequence needs {seq_tokens} (the longest prompt + "
            f"--max-response-len); "
            "raise --kv-blocks, or leave the cache to --gpu-memory-utilization"
        )
    if fits < 1:
        raise ResourceError(
            f"not even one sequence fits in the KV cache: {seq_tokens} tokens x {per_token / 2**10:.0f} KiB per token "
            f"at "
            f"{planes} planes = {seq_tokens * per_token / GIB:.2f} GiB, but {max(turns, 0) / GIB:.2f} GiB of {what} "
            f"memory are left after {resident / GIB:.1f} GiB of weights and optimizer state; raise "
            "--gpu-memory-utilization, lower --max-response-len, or pass --offload-optimizer on"
        )
    if max_num_seqs is None:
        max_num_seqs = max(1, min(sequences_needed, MAX_DEFAULT_SEQS))

    train_room = turns - grads if engine_releases_memory else turns - kv_bytes
    if per_call:
        # the micro-batches leave the state its room, unless that leaves too few for a sample
        # (or for the micro-batches asked for: then the state goes to the host between steps)
        if max_tokens_per_micro_batch is not None:
            per = activation_bytes_per_token(config, dtype, recompute == "on", seq_tokens, exact)
            fits = max_tokens_per_micro_batch * per <= train_room - state
        else:
            fits = train_room - state >= activation_bytes_per_token(config, dtype, True, seq_tokens, exact) * seq_tokens
        if fits and room(False) > 0:
            train_room -= state
        else:
            per_call = False
    sized_here = max_tokens_per_micro_batch is None
    if max_tokens_per_micro_batch is None:
        off = activation_bytes_per_token(config, dtype, False, seq_tokens, exact)
        on = activation_bytes_per_token(config, dtype, True, seq_tokens, exact)
        if recompute == "auto":
            recompute = "off" if train_room // off >= min(tokens_per_update, MIN_EFFICIENT_MICRO_BATCH) else "on"
        per = on if recompute == "on" else off
        max_tokens_per_micro_batch = max(0, train_room) // per // TOKEN_ALIGN * TOKEN_ALIGN
        if max_tokens_per_micro_batch < seq_tokens:
            raise ResourceError(
                f"one sample of {seq_tokens} tokens does not fit a training micro-batch: it needs "
                f"{seq_tokens * per / GIB:.2f} GiB of activations (recompute {recompute}), "
                f"{max(train_room, 0) / GIB:.2f} GiB of {what} memory are left; raise --gpu-memory-utilization, "
                "lower --max-response-len, or pass --offload-optimizer on"
            )
    elif recompute == "auto":
        off = activation_bytes_per_token(config, dtype, False, seq_tokens, exact)
        recompute = "off" if max_tokens_per_micro_batch * off <= train_room else "on"
    if token_cost == "auto":
        token_cost = token_cost_shares(config, recompute == "on", exact) if sized_here else None
    return RunSizing(
        budget_bytes=budget,
        resident_bytes=resident,
        kv_blocks=int(kv_blocks),
        kv_bytes=int(kv_bytes),
        max_num_seqs=int(max_num_seqs),
        max_tokens_per_micro_batch=int(max_tokens_per_micro_batch),
        recompute=recompute == "on",
        engine_releases_memory=engine_releases_memory,
        offload_optimizer=offloads,
        gradients_released=released,
        state_per_call=per_call,
        kv_room_beside_state=max(0, room(False)) if per_call else 0,
        token_cost=token_cost,
        prompt_heads=prompt_heads,
        deep_parts_first=deep_parts_first,
    )


def check_fits(sizing: RunSizing, memory: DeviceMemory, used_now: int) -> None:
    """The plan against the device as it is: `used_now` bytes are in use by this process
    (weights built); the plan's budget must not exceed what is in use plus what is free.
    (On CPU the budget was taken from the free memory already.)"""
    if memory.kind == "cuda" and sizing.budget_bytes > used_now + memory.free:
        other = memory.total - memory.free - used_now
        raise ResourceError(
            f"the run's memory budget is {sizing.budget_bytes / GIB:.1f} GiB but only "
            f"{(used_now + memory.free) / GIB:.1f} GiB are available to it ({other / GIB:.1f} GiB are held by other "
            "processes); lower --gpu-memory-utilization or free the device"
        )


def describe(
    sizing: RunSizing,
    config: OuroConfig,
    memory: DeviceMemory,
    *,
    block_size: int,
    seq_tokens: int,
    dtype: torch.dtype,
    planes: list[int],
    tokens_per_update: int | None = None,
) -> str:
    """One log line: the budget, and what it buys at each K the run decodes at. A micro-batch
    limit above this rank's replay tokens of an update (`tokens_per_update`) is shown beside
    them: the limit is what the memory allows, not what a step holds."""
    per_seq = math.ceil(seq_tokens / block_size) * block_size  # a sequence holds whole blocks
    per_k = ", ".join(f"{sizing.tokens_at(p, config, block_size) // per_seq} at K={p}" for p in planes)
    limit = sizing.max_tokens_per_micro_batch
    micro = f"micro-batches of up to {limit} tokens{' at full depth' if sizing.token_cost else ''}"
    if tokens_per_update is not None and limit > tokens_per_update:
        micro += f" (the memory's limit; an update has at most {tokens_per_update})"
    return (
        f"memory: {sizing.budget_bytes / GIB:.1f} GiB budget of {memory.total / GIB:.1f} GiB "
        f"({memory.kind}); resident {sizing.resident_bytes / GIB:.1f} GiB; KV cache {sizing.kv_bytes / GIB:.2f} GiB "
        f"= sequences of {seq_tokens} tokens: {per_k} (max_num_seqs {sizing.max_num_seqs}); {micro}, recompute "
        f"{'on' if sizing.recompute else 'off'}"
        + (
            "; optimizer state in host memory during the rollouts it does not fit beside"
            if sizing.state_per_call
            else "; optimizer state in host memory between steps"
            if sizing.offload_optimizer
            else ""
        )
        + ("" if sizing.engine_releases_memory else " (the engine keeps its cache during training)")
    )
