"""The GRPO update loop behind `ouro train` and `ouro resume`, read top to bottom.

    setup        data + reward + template checked before any model loads; trainer
                 (Megatron-core) and colocated engine built; initial publication
    per update   K = depths[u % len]; prompts = cursor; rollout → rewards → refill
                 rounds (--filter-groups) → group advantages → train steps (one per
                 --mini-batches run, --epochs times) → rank check → publish (version + 1)
                 → save → evaluate → one metrics line   (docs/grpo.md)
    end          final evaluation, optional HF export, metrics.png (--plot)

Data parallelism (torchrun): every rank runs this loop. The ranks check that they agree
on the run's contract and on each update's (update, K, prompts) before sampling; rank r
samples the prompts at global positions r, r + N, … with seeds that depend on the
position only, so N ranks sample what one rank would. After each optimizer step every
rank hashes its parameters and the ranks compare: replicas that differ by one bit stop
the run (exit 1) naming the update, before anything is published or saved. The metrics
line shows every rank (`rank_*` lists, `plan_agreed_ranks`, `params_identical_across_ranks`).

Policy versions: the engine starts at version 0 with the checkpoint's weights; the
trainer's weights are published as version `start + 1` before the first rollout, and
after update u as version u + 2. Rollouts of update u therefore carry version u + 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ouro_cli import env
from ouro_cli.artifacts import MANIFEST, is_complete, mark_complete, write_manifest
from ouro_cli.engine.contract import LimitsMemory
from ouro_cli.errors import CheckFailed, Interrupted, UserError, is_device_fault
from ouro_cli.outputs import check_output, clear_dir, is_empty_dir
from ouro_cli.testing import faults

from . import allocator, recovery
from . import plan as plans
from . import records as run_records
from .advantages import group_advantages, length_penalty, zero_variance
from .cursor import DataCursor
from .data import Row, columns_for, data_sha256, load_dataset, load_held_out
from .digest import params_sha256, state_digest
from .evaluate import evaluate
from .groups import first_groups, refill_size, split_groups
from .loggers import Trackers
from .metrics import (
    append_jsonl,
    counter_delta,
    device_hours,
    rollout_summary,
    tenths,
)
from .options import EngineOptions, TrainOptions
from .phases import hand_back, phase
from .plots import plot_run
from .progress import RunProgress, Silent, Stage
from .prompts import stop_tokens_for, tokenize_prompts
from .publish import publish
from .rewards import Grader, check_labels, load_reward
from .rollout import RolloutCheckFailed, RolloutSample, RolloutSampling, generate_groups
from .run_dir import RunDir
from .schedule import depth_for_update, validate_depths, validate_min_loops
from .sizing import (
    CUDA_RUNTIME_RESERVE,
    CallShape,
    DeviceMemory,
    RunSizing,
    call_kv_bytes,
    check_fits,
    describe,
    size_run,
)
from .stop import StopSignals, signal_name, wants_save
from .template import get_template, template_for_checkpoint

NO_SAVE = {
    "save_s": 0.0,
    "save_compile_s": 0.0,
    "peak_memory_save_gib": None,
    "peak_held_save_gib": None,
    "save_alloc_retries": None,
}


@dataclass
class Session:
    options: TrainOptions
    run: RunDir
    rows: list[Row]
    prompt_ids: list[list[int]]
    eval_rows: list[Row]
    eval_prompt_ids: list[list[int]]
    reward_fn: Grader
    sampling: RolloutSampling  # the rollouts'; evaluations use it with the run seed (`eval_sampling`)
    trainer: Any
    engine: Any
    cursor: DataCursor
    plan: dict[str, Any]
    start_update: int
    sizing: RunSizing
    config: Any = None  # the model's OuroConfig
    seq_tokens: int = 0  # the longest prompt + --max-response-len
    prompt_tokens: int = 0  # the longest prompt
    rank: int = 0
    world: int = 1
    devices: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.perf_counter)
    trackers: Trackers = field(default_factory=Trackers)  # --logger (rank 0)
    # the last save ran after its update's metrics line: the next line gets its figures
    unlogged_save: dict[str, Any] = field(default_factory=lambda: dict(NO_SAVE))
    # the last held-out evaluation's phase figures (time, peaks), for the next metrics line
    unlogged_evaluation: dict[str, Any] = field(default_factory=dict)
    # out-of-memory decisions of this rank's current update, not yet recorded (rl/recovery.py)
    new_decisions: list[dict[str, Any]] = field(default_factory=list)
    progress: RunProgress = field(default_factory=Silent)  # what the user sees of it (rl/progress.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def eval_sampling(self) -> RolloutSampling:
        return dataclasses.replace(self.sampling, seed=self.options.seed)

    @property
    def generating(self) -> Any:
        """The engine's count of its current generate call (contract.GenerateProgress), or None."""
        from ouro_cli.engine.contract import ReportsProgress

        return self.engine.generate_progress if isinstance(self.engine, ReportsProgress) else None


# ---- setup ---------------------------------------------------------------------------


def _check_present(options: TrainOptions) -> None:
    """The data files exist; a missing one is named by its flag and its path as first given. The
    held-out set is outside the run's contract, so the line says how to continue without it."""
    if not Path(options.data).exists():
        raise UserError(
            f"the training data --data {options.shown_path('data')} does not exist; give an existing "
            "file (a run resumes only on its own data, whose sha256 it checks: restore it there)"
        )
    if options.eval_data and not Path(options.eval_data).exists():
        raise UserError(
            f"the held-out set --eval-data {options.shown_path('eval_data')} does not exist; it is not "
            "part of the run's contract: pass --eval-data with another held-out file, or --eval-data '' "
            "to evaluate nothing"
        )


def check_inputs(options: TrainOptions):
    """Everything that can be wrong with the inputs, found before any model loads: (training
    rows, held-out rows, grader, prompt template or None for the model's own)."""
    _check_present(options)
    rows = load_dataset(options.data, columns_for(options))
    eval_rows = load_held_out(options)
    reward_fn = load_reward(options.task.reward_function)
    check_labels(
        reward_fn,
        options.task.reward_function,
        [(f"{options.data}:{r.line}", r.label) for r in rows]
        + [(f"{options.eval_data}:{r.line}", r.label) for r in eval_rows],
    )
    if not options.engine.disaggregated:  # a bad --engine path is a usage error, found before any model loads
        from ouro_cli.engine.factory import load_factory

        load_factory(options.engine.factory)
    name = options.task.prompt_template
    template = get_template(name) if name != "tokenizer" else None
    if template is not None:
        template.check([(f"{options.data}:{r.line}", r.prompt) for r in rows])
    if options.prompts_per_update > len(rows):
        raise UserError(
            f"--prompts-per-update {options.prompts_per_update} is more than the {len(rows)} rows of "
            f"{options.data}: an update would repeat prompts; use at most {len(rows)}"
        )
    return rows, eval_rows, Grader(reward_fn, options.task.reward_function, options.task.reward_timeout), template


def _trainer_config(options: TrainOptions, sizing: RunSizing):
    """The run's trainer config with what the run decides filled in: the memory plan's micro-batch
    tokens (and how positions count against them, and whether samples split into prompt heads),
    recompute and optimizer offload (rl/sizing.py), the aggregation "auto" stands for
    (constant_length under --advantage dr-grpo, over --max-response-len), and the LR schedule in optimizer steps: the
    warmup (--warmup-steps counts updates) and a cosine schedule's length (--lr-decay-updates,
    resolved when the run started), each
    times the steps of an update (--mini-batches × --epochs; Trainer.train_update)."""
    t, steps = options.trainer, options.optimizer_steps_per_update
    aggregation = t.aggregation
    if aggregation == "auto":
        aggregation = "constant_length" if options.advantage == "dr-grpo" else "token_mean"
    return dataclasses.replace(
        t,
        max_tokens_per_micro_batch=sizing.max_tokens_per_micro_batch,
        micro_batch_token_cost=sizing.token_cost,
        prompt_heads=sizing.prompt_heads,
        deep_parts_first=sizing.deep_parts_first,
        recompute="on" if sizing.recompute else "off",
        offload_optimizer="on" if sizing.offload_optimizer else "off",
        aggregation=aggregation,
        aggregation_length=options.sampling.max_response_len,
        warmup_steps=t.warmup_steps * steps,
        decay_steps=(options.lr_decay_updates or options.updates) * steps if t.lr_schedule == "cosine" else None,
    )


def _all_gather(value: Any) -> list[Any]:
    """`value` from every rank, in rank order ([value] without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _agree(value: Any, what: str) -> int:
    """All ranks must hold the same `value` (the execution plan); a mismatch is an error.
    Returns how many ranks agreed (the world size)."""
    gathered = _all_gather(value)
    if any(g != gathered[0] for g in gathered):
        raise CheckFailed(f"ranks disagree on the {what}: {gathered}")
    return len(gathered)


def check_rank_params(update: int, digests: list[str]) -> bool:
    """Data-parallel replicas must hold bit-identical parameters after every step; a
    divergence (a missed gradient sync, a non-deterministic optimizer) would silently
    train N different models, so it stops the run before the weights are published."""
    if len(set(digests)) > 1:
        shown = ", ".join(f"rank {r} {d[:12]}" for r, d in enumerate(digests))
        raise CheckFailed(f"update {update}: trainer parameters differ across data-parallel ranks ({shown})")
    return True


def _agreed(memory: DeviceMemory) -> DeviceMemory:
    """The least total and free memory over the ranks: every rank sizes the run from the same
    figures, so the memory plans in the execution plans they compare are the same (free host
    memory moves between two ranks' reads)."""
    every = _all_gather(memory)
    return DeviceMemory(memory.kind, min(m.total for m in every), min(m.free for m in every))


def _local_samples(options: TrainOptions, world: int) -> int:
    """The most samples one of `world` ranks rolls out and trains in an update."""
    return -(-options.prompts_per_update // world) * options.group_size


def _size(
    options: TrainOptions, config, seq_tokens: int, prompt_tokens: int, eval_rows: int, saved: dict[str, Any] | None
) -> RunSizing:
    """The run's memory plan (rl/sizing.py), from memory figures every rank agrees on; a resumed
    run keeps the one its plan recorded."""

    from ouro_cli.mcore.process import launched_ranks
    from ouro_cli.trainer.setup import join_world

    world = launched_ranks()
    join_world(options.trainer.resolved_device)  # the trainer built after this takes the group over
    memory = _agreed(DeviceMemory.of(run_device(options)))
    return memory_plan(
        options,
        config,
        memory,
        seq_tokens=seq_tokens,
        prompt_tokens=prompt_tokens,
        eval_rows=eval_rows,
        saved=saved,
        world=world,
    )


def run_device(options: TrainOptions) -> torch.device:
    """The device this rank's trainer and engine use."""
    if options.trainer.resolved_device == "cuda":
        return torch.device("cuda", env.local_rank())
    return torch.device("cpu")


def memory_plan(
    options: TrainOptions,
    config,
    memory: DeviceMemory,
    *,
    seq_tokens: int,
    eval_rows: int,
    saved: dict[str, Any] | None,
    world: int,
    prompt_tokens: int | None = None,
) -> RunSizing:
    """The memory plan of a run of `world` ranks on a device with `memory`, from the model's
    shapes and the options alone (`ouro train --dry-run` sizes a run with it too). With
    `prompt_tokens` (the longest prompt) the cache counts a group's prompt once."""
    t, e = options.trainer, options.engine
    local_samples = _local_samples(options, world)
    evaluated = min(options.eval_prompts, eval_rows)
    calls = [
        CallShape(local_samples, local_samples // options.group_size),
        CallShape(evaluated * options.eval_samples, evaluated),
    ]
    recorded = (saved or {}).get("contract", {}).get("sizing") or {}
    given = t.max_tokens_per_micro_batch
    if saved is None and given is not None and given < seq_tokens:  # the run would fail at its first long sample
        raise UserError(
            f"--max-tokens-per-micro-batch {given} is less than one sample can take: the longest prompt + "
            f"--max-response-len = {seq_tokens} tokens; raise it to at least {seq_tokens}, or leave it "
            "to the memory plan"
        )
    planes = config.num_loops if e.speculative_tokens else max(options.depths + options.eval_depths)
    return size_run(
        config,
        memory,
        utilization=options.gpu_memory_utilization,
        dtype=t.torch_dtype,
        block_size=e.block_size,
        seq_tokens=seq_tokens,
        sequences_needed=max(c.sequences for c in calls),
        tokens_per_update=local_samples * seq_tokens,
        planes=planes,
        engine_releases_memory=e.releases_memory,
        offload_optimizer=t.offload_optimizer,
        optimizer_shards=world if t.use_distributed_optimizer else 1,
        kv_blocks=recorded.get("kv_blocks", e.kv_blocks),
        max_num_seqs=recorded.get("max_num_seqs", e.max_num_seqs),
        max_tokens_per_micro_batch=recorded.get("max_tokens_per_micro_batch", t.max_tokens_per_micro_batch),
        recompute={True: "on", False: "off"}.get(recorded.get("recompute"), t.recompute),
        exact=options.execution.exact,
        prompt_tokens=prompt_tokens if e.shares_prompts else None,
        calls=calls,
        fp8_kv=options.execution.fp8_kv,
        # a resumed run cuts its micro-batches as it did (a plan lacking one is refused by its contract)
        **{k: recorded[k] for k in ("token_cost", "prompt_heads", "deep_parts_first") if k in recorded},
    )


def _make_engine(options: EngineOptions, model, sizing: RunSizing, device: torch.device, log: Callable[[str], None]):
    """The run's engine (`EngineOptions`): the factory's, or the PD engine's spawned prefill and
    decode workers behind the same contract; the memory plan sizes its cache and batch."""
    engine_options = dict(max_num_seqs=sizing.max_num_seqs, kv_blocks=sizing.kv_blocks, block_size=options.block_size)
    if options.cuda_graphs:
        if device.type != "cuda":
            raise UserError("--cuda-graphs needs a CUDA device (decode steps are captured as CUDA graphs)")
        engine_options["cuda_graphs"] = True
    if options.disaggregated:
        from ouro_cli.engine.pd import make_pd_engine

        engine = make_pd_engine(
            model,
            options.prefill_devices,
            options.decode_devices,
            device=device.type,
            transport=options.kv_transport,
            worker_threads=options.pd_worker_threads,
            **engine_options,
        )
        log(
            f"engine: PD, prefill {options.prefill_devices} decode {options.decode_devices}, "
            f"KV transport {engine.transport}"
        )
        return engine
    from ouro_cli.engine import make_engine

    if options.async_scheduling:
        engine_options["async_scheduling"] = True
    if options.built_in_local and not options.share_prompts:
        engine_options["share_prompts"] = False
    return make_engine(options.factory, model, **engine_options)


def _in_use(device: torch.device) -> int:
    """Bytes this process holds on `device` through PyTorch's allocator (0 on CPU: host memory
    is checked against the budget as a whole)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def check_model(options: TrainOptions, config) -> int:
    """The options against the model's config (depths, loops, positions); returns the token limit
    of a prompt + response."""
    num_loops = config.num_loops
    validate_depths(options.depths, num_loops)
    validate_depths(options.eval_depths, num_loops, flag="--eval-depths")
    validate_min_loops(options.sampling.min_loops, num_loops)
    if options.engine.speculative_tokens and options.depths != [num_loops]:
        raise UserError(
            f"--speculative-tokens needs --depths {num_loops} (the model's total_ut_steps T): drafts are "
            f"verified at full depth, got --depths {' '.join(map(str, options.depths))}"
        )
    if options.max_position_embeddings not in (None, config.max_position_embeddings):
        raise UserError(
            f"--max-position-embeddings {options.max_position_embeddings} does not match the model's "
            f"{config.max_position_embeddings}"
        )
    return min(options.seq_length or config.max_position_embeddings, config.max_position_embeddings)


def encode_prompts(
    options: TrainOptions, path: Path, assets: Path, template, rows: list[Row], eval_rows: list[Row], limit: int
):
    """(codec, template, training prompt ids, held-out prompt ids) with the tokenizer in `assets`
    (the checkpoint at `path`'s); `template` None is the model's own chat template. A prompt
    that leaves no room for --max-response-len tokens under `limit` is an error naming its row."""
    from ouro_cli.engine.tokenizer import TextCodec

    codec = TextCodec.from_dir(assets)
    if codec is None:
        raise UserError(f"{path} has no tokenizer.json; ouro train needs the model's tokenizer")
    if template is None:  # the checkpoint's chat template (never AutoTokenizer: it asks about remote code)
        template = template_for_checkpoint("tokenizer", assets)
    response_len = options.sampling.max_response_len
    prompt_ids = tokenize_prompts(codec, template, rows, limit, response_len, options.data)
    eval_prompt_ids = tokenize_prompts(codec, template, eval_rows, limit, response_len, options.eval_data or "")
    return codec, template, prompt_ids, eval_prompt_ids


def setup(
    options: TrainOptions,
    run: RunDir,
    *,
    resume: bool,
    override_scheduler: bool = False,
    log: Callable[[str], None] = lambda s: None,
    progress: RunProgress | None = None,
) -> Session:
    progress = progress or Silent()
    rows, eval_rows, reward_fn, template = check_inputs(options)  # before anything heavy is imported
    allocator.prepare(disaggregated=options.engine.disaggregated)  # before the run's first CUDA allocation

    from ouro_cli.checkpoint import open_checkpoint
    from ouro_cli.model import from_state_dict
    from ouro_cli.trainer.setup import leave_world

    log(f"data: {len(rows)} training rows, {len(eval_rows)} held-out rows; reward {options.task.reward_function}")

    source_path = run.checkpoint if resume else Path(options.model)
    source = open_checkpoint(source_path)
    config = source.config
    num_loops = config.num_loops
    limit = check_model(options, config)
    codec, template, prompt_ids, eval_prompt_ids = encode_prompts(
        options, source.path, source.assets_dir, template, rows, eval_rows, limit
    )
    response_len = options.sampling.max_response_len

    if not resume and options.lr_decay_updates is None:  # the schedule's length is fixed when the run starts
        options = dataclasses.replace(options, lr_decay_updates=options.updates)
    contract = plans.build_contract(
        options,
        data_sha256=data_sha256(options.data),
        model_config=config.to_dict(),
        tokenizer_sha256=plans.file_sha256(source.assets_dir / "tokenizer.json"),
        template=template.plan_entry(),
        num_loops=num_loops,
    )
    saved = None
    if resume:
        from ouro_cli.checkpoint.layout import latest_iteration_dir

        saved = plans.read_plan(latest_iteration_dir(run.checkpoint) / run.plan.name)
    prompt_tokens = max(map(len, prompt_ids + eval_prompt_ids))
    seq_tokens = prompt_tokens + response_len
    try:  # a run that stops before its trainer exists leaves the process group _size joined
        sizing = _size(options, config, seq_tokens, prompt_tokens, len(eval_rows), saved)
        contract["sizing"] = plans.sizing_entry(sizing)
        cursor = DataCursor(len(rows), options.seed)
        if resume:
            plans.check_same_contract(saved["contract"], contract, allow_scheduler=override_scheduler)
            plan = dict(saved)
            # out-of-memory decisions recorded after the checkpoint replay too (rl/recovery.py)
            root = plans.read_plan(run.plan) if run.plan.is_file() else None
            if recovery.decisions(saved) or (root and recovery.decisions(root)):
                plan[recovery.KEY] = recovery.merged(saved, root)
        else:
            plan = plans.new_plan(options, contract, cursor.state_dict(), sizing.to_dict())

        from ouro_cli.trainer import Trainer  # megatron-core: imported once the run's checks have passed

        log(f"trainer: Megatron-core, {source.kind} checkpoint {source.path}")
        trainer = Trainer(str(source_path), _trainer_config(options, sizing), execution=options.execution)
    except BaseException:
        leave_world()
        raise
    finally:
        source.release()  # what the run reads of it is read: the run's own saves may prune it
    if trainer.offload is not None:  # --offload-optimizer auto: the state leaves only for the calls that need it
        trainer.offload.keep_after_step = sizing.state_per_call
    # the process group exists from here on (the trainer creates or joins it)
    contract_sha = plans.contract_hash(contract)
    agreed = _agree(contract_sha, "execution plan")
    if agreed > 1:
        log(f"execution plan {contract_sha[:12]}: the same on all {agreed} ranks")
    else:
        progress.detail(f"execution plan {contract_sha[:12]} (ouro-plan.json)")
    if options.prompts_per_update < agreed:
        raise UserError(
            f"--prompts-per-update {options.prompts_per_update} is less than the {agreed} data-parallel "
            "ranks; give every rank at least one prompt"
        )
    start_update = 0
    if resume:
        extra = trainer.load(run.checkpoint)
        plans.check_cursor(plan, extra)
        cursor.load_state_dict(extra["cursor"])
        start_update = int(extra["next_update"])
    if sizing.gradients_released:
        trainer.release_gradients()  # the memory plan gave their memory to the KV cache until the first backward
    weights = {name: t.detach().clone() for name, t in trainer.named_weights_for_publication()}
    engine_model = from_state_dict(config, weights, device=trainer.device)
    engine_model.execution = options.execution  # the engine computes with its model's settings
    del weights
    check_fits(sizing, DeviceMemory.of(trainer.device), _in_use(trainer.device))
    allocator.cap(trainer.device, sizing.budget_bytes, CUDA_RUNTIME_RESERVE)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    log(
        describe(
            sizing,
            config,
            DeviceMemory.of(trainer.device),
            block_size=options.engine.block_size,
            seq_tokens=seq_tokens,
            dtype=trainer.config.torch_dtype,
            planes=sorted(set(options.depths) | set(options.eval_depths)),
            tokens_per_update=_local_samples(options, world) * seq_tokens,
        )
    )
    engine = _make_engine(options.engine, engine_model, sizing, trainer.device, log)
    sampling = RolloutSampling.of(
        options.sampling,
        num_loops=num_loops,
        seed=options.seed + (1 if resume and faults.broken_resume() else 0),
        stop_token_ids=stop_tokens_for(config, codec),
        decode=codec.decode,
        speculative_tokens=options.engine.speculative_tokens,
        async_scheduling=options.engine.async_scheduling,
    )
    session = Session(
        options=options,
        run=run,
        rows=rows,
        prompt_ids=prompt_ids,
        eval_rows=eval_rows,
        eval_prompt_ids=eval_prompt_ids,
        reward_fn=reward_fn,
        sampling=sampling,
        trainer=trainer,
        engine=engine,
        cursor=cursor,
        plan=plan,
        start_update=start_update,
        rank=rank,
        world=world,
        sizing=sizing,
        config=config,
        seq_tokens=seq_tokens,
        prompt_tokens=prompt_tokens,
        devices={str(trainer.device), *getattr(engine, "devices", set)()},
        progress=progress,
    )
    if session.is_main and options.loggers:
        session.trackers = Trackers.open(options, run, start_update=start_update, resume=resume)
    if session.is_main and not resume:
        from ouro_cli.checkpoint.megatron import write_hf_assets

        write_hf_assets(run.checkpoint, config, source.assets_dir)
        plans.write_plan(run.plan, plan)
    stats = publish(engine, trainer.named_weights_for_publication(), version=start_update + 1)
    kv = getattr(engine, "kv", None)  # LLM's cache; other engines keep theirs to themselves
    where = (
        ""
        if kv is None or kv.device.type != "cuda"
        else (
            "; KV cache at a fixed address (its CUDA graphs kept across train steps)"
            if kv.fixed_address
            else "; KV cache allocated anew each rollout (cuda-bindings missing, or no CUDA virtual memory "
            "management: its CUDA graphs are captured again every update)"
        )
    )
    sharing = getattr(engine, "share_prompts", None)  # LLM's; other engines do not say
    if sharing is not None:
        where += "; a group's prompt K/V held once" if sharing else "; a prompt K/V copy per sample"
    log(f"engine: {type(engine).__name__}{where}")
    published = f"{stats['publish_s'] * 1e3:.1f} ms"
    progress.detail(f"weights published to the engine as version {start_update + 1} ({published})")
    hand_back(engine, trainer.device)  # the first call allocates the cache it needs (engine.kv_cache)
    return session


# ---- one update, stage by stage ------------------------------------------------------


def rollout_stage(
    s: Session, update: int, k: int, *, start: int = 0, prompts: int | None = None
) -> tuple[list[RolloutSample], int]:
    """This rank's samples of the next `prompts` (default --prompts-per-update) prompts of the
    cursor, which take the update's batch positions start, start + 1, …; and how many ranks
    agreed on them."""
    batch = s.cursor.next_batch(prompts or s.options.prompts_per_update)
    agreed = _agree((update, k, start, batch), "update plan (update, K, first position, prompts)")
    positions = range(start + s.rank, start + len(batch), s.world)
    mine = [batch[p - start] for p in positions]
    if not mine:  # a refill round smaller than the rank count
        return [], agreed
    room_for_call(s, k, len(mine) * s.options.group_size, len(mine))

    def call() -> list[RolloutSample]:
        faults.point("generate", s.trainer.device)
        return generate_groups(
            s.engine,
            [s.rows[i] for i in mine],
            [s.prompt_ids[i] for i in mine],
            s.sampling,
            group_size=s.options.group_size,
            k=k,
            update=update,
            positions=positions,
        )

    try:
        if not isinstance(s.engine, LimitsMemory):
            return call(), agreed
        limit = recovery.kv_limit(s.plan, update, s.rank)
        s.engine.limit_kv_blocks(limit)
        planes = s.config.num_loops if s.sampling.speculative_tokens else k
        samples = recovery.generate_with_recovery(
            call,
            s.engine,
            limit=limit,
            capacity=s.sizing.kv_blocks,
            floor=s.engine.min_kv_blocks(s.seq_tokens, planes),
            on_decision=lambda blocks: s.new_decisions.append(
                {"update": update, "rank": s.rank, "phase": "rollout", "what": "kv_blocks", "kv_blocks": blocks}
            ),
        )
        return samples, agreed
    except RolloutCheckFailed as err:
        raise CheckFailed(f"update {update}: {err}") from err


def record_decisions(s: Session) -> list[dict[str, Any]]:
    """Every rank's out-of-memory decisions of this update (rl/recovery.py), recorded in the
    run's plan at once (rank 0 writes it), not only with the next checkpoint."""
    mine, s.new_decisions = s.new_decisions, []
    every = [d for part in _all_gather(mine) for d in part]
    if every:
        s.plan = {**s.plan, recovery.KEY: recovery.decisions(s.plan) + every}
        if s.is_main:
            plans.write_plan(s.run.plan, s.plan)
    return every


def room_for_call(s: Session, k: int, sequences: int, prompts: int | None = None) -> None:
    """Before a generate call of `sequences` requests on `prompts` distinct prompts (None: as many
    as requests) at budget K: under `--offload-optimizer auto` the optimizer state leaves the
    device only when the call's cache (`sizing.call_kv_bytes`, T planes when the run speculates)
    would not fit beside it; the next optimizer step brings it back (Trainer.optimizer_step)."""
    offload = s.trainer.offload
    if offload is None or offload.on_host or not s.sizing.state_per_call:
        return
    draft = s.sampling.speculative_tokens
    need = call_kv_bytes(
        s.config,
        s.trainer.config.torch_dtype,
        block_size=s.options.engine.block_size,
        planes=s.config.num_loops if draft else k,
        sequences=sequences,
        seq_tokens=s.seq_tokens,
        kv_blocks=s.sizing.kv_blocks,
        draft_tokens=draft,
        prompts=prompts,
        prompt_tokens=s.prompt_tokens,  # the state moves per call only beside the built-in engine, which shares
        fp8_kv=s.options.execution.fp8_kv,
    )
    if not s.sizing.state_fits(need):
        offload.to_host()
        if s.trainer.device.type == "cuda":
            # the KV cache maps device memory outside PyTorch's allocator (engine/kv_memory.py):
            # the state's freed blocks must go back to the device, not stay in the allocator's cache
            torch.cuda.empty_cache()


def refill_stage(s: Session, update: int, k: int, samples: list[RolloutSample]) -> tuple[list[int], dict[str, Any]]:
    """The positions of the groups the update trains, in order, and what choosing them took.

    Without --filter-groups: every group of the batch. With it: groups whose raw rewards are
    all equal are dropped, and refill rounds (same K, same weights, the seeds of the positions
    they take) draw more prompts from the cursor until --prompts-per-update groups remain or
    --max-refill prompts were drawn (rl/groups.py). `samples` gains the refill rounds' samples."""
    wanted = s.options.prompts_per_update
    if not s.options.filter_groups:
        return list(range(wanted)), {
            "prompts_drawn": wanted,
            "groups_filtered": 0,
            "groups_trained": wanted,
            "refill_rounds": 0,
            "refill_exhausted": False,
        }
    flags = _group_flags(samples)
    drawn, budget, rounds = wanted, s.options.refill_budget, 0
    while True:
        kept = sum(signal for _, signal in flags)
        n = refill_size(wanted=wanted, kept=kept, drawn=drawn, budget_left=budget, per_round=wanted)
        if n == 0:
            break
        more, _ = rollout_stage(s, update, k, start=drawn, prompts=n)
        score_stage(s, update, more)
        samples.extend(more)
        flags += _group_flags(more)
        drawn, budget, rounds = drawn + n, budget - n, rounds + 1
    trained = first_groups(flags, wanted)
    return trained, {
        "prompts_drawn": drawn,
        "groups_filtered": sum(not signal for _, signal in flags),
        "groups_trained": len(trained),
        "refill_rounds": rounds,
        "refill_exhausted": len(trained) < wanted,
    }


def _group_flags(samples: list[RolloutSample]) -> list[tuple[int, bool]]:
    """(position, carries signal) of every group, from every rank: signal is a raw reward that
    differs within the group (a shaped reward never decides)."""
    rewards: dict[int, list[float]] = {}
    for x in samples:
        rewards.setdefault(x.group, []).append(x.reward)
    mine = [(group, not zero_variance(r)) for group, r in rewards.items()]
    return sorted(flag for part in _all_gather(mine) for flag in part)


def score_stage(s: Session, update: int, samples: list[RolloutSample]) -> None:
    """Raw rewards. A reward that is not a finite real number, raises or runs past
    --reward-timeout stops the run (exit 1) before anything trains on the update, naming the
    function, the problem and the value (rewards/grading.py); the ranks agree first, so none
    waits in a collective."""
    problem = None
    for sample in samples:
        try:
            sample.reward = s.reward_fn(
                sample.text,
                sample.row.label,
                sample.row.metadata,
                problem_id=sample.row.problem_id,
                where=f"update {update}",
            )
        except CheckFailed as err:
            problem = str(err)
            break
    problems = [p for p in _all_gather(problem) if p is not None]
    if problems:
        raise CheckFailed(problems[0])


def advantage_stage(s: Session, samples: list[RolloutSample]) -> None:
    """Shaped rewards (raw + --overlong soft's length penalty), then each group's advantages by
    --advantage (rl/advantages.py); this rank holds whole groups."""
    o = s.options
    for x in samples:
        x.penalty = (
            length_penalty(len(x.response_ids), o.sampling.max_response_len, o.length_buffer)
            if o.overlong == "soft"
            else 0.0
        )
    shaped = [x.reward + x.penalty for x in samples]
    for sample, adv in zip(samples, group_advantages(shaped, o.group_size, o.advantage), strict=True):
        sample.advantage = adv


def train_stage(s: Session, update: int, samples: list[RolloutSample], trained: list[int]) -> dict[str, Any]:
    """The trained groups cut into --mini-batches runs of whole groups (rl/groups.py), each this
    rank's share of one optimizer step, --epochs times over. --overlong mask leaves truncated
    responses out of the loss (their group's advantages were taken with them). A step that runs
    out of memory runs again with smaller micro-batches (rl/recovery.py, `retry_step`)."""
    from ouro_cli.trainer import Sample

    chosen = set(trained)
    masked = 0
    for x in samples:
        x.trained = x.group in chosen and not (s.options.overlong == "mask" and x.finish_reason == "length")
        masked += x.group in chosen and not x.trained
    runs = [set(run) for run in split_groups(trained, s.options.mini_batches)]
    batches = [
        [
            Sample(
                prompt_ids=x.prompt_ids,
                response_ids=x.response_ids,
                exit_depths=x.exit_depths,
                rollout_logprobs=x.logprobs,
                advantage=x.advantage,
                temperature=s.sampling.temperature,
            )
            for x in samples
            if x.trained and x.group in run
        ]
        for run in runs
    ]
    metrics = s.trainer.train_update(
        batches, epochs=s.options.epochs, retry=lambda step, attempt: retry_step(s, update, step, attempt)
    )
    metrics["overlong_masked"] = sum(_all_gather(masked))
    return metrics


def retry_step(s: Session, update: int, step: int, attempt: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Train step `step` of `update` on this rank (its forward and backward passes, `attempt`),
    its micro-batches cut at the lowest limit recorded at or before it (this update's own
    decisions included), else the memory plan's; an out-of-memory halves the limit, down to
    the longest sample the run can hold, and is recorded like the rollout's (rl/recovery.py)."""
    known = {recovery.KEY: recovery.decisions(s.plan) + s.new_decisions}
    s.trainer.limit_micro_batch_tokens(
        recovery.micro_batch_limit(known, update, step, s.rank) or s.sizing.max_tokens_per_micro_batch
    )
    return recovery.train_step_with_recovery(
        attempt,
        s.trainer,
        floor=s.seq_tokens,
        on_decision=lambda tokens: s.new_decisions.append(
            {
                "update": update,
                "rank": s.rank,
                "phase": "train",
                "step": step,
                "what": "max_tokens_per_micro_batch",
                "max_tokens_per_micro_batch": tokens,
            }
        ),
    )


def check_step(update: int, train: dict[str, Any], last_checkpoint: int) -> None:
    """A non-finite loss or gradient norm must never reach the engine or a checkpoint: the
    optimizer skipped the step (trainer/step.py), and the run stops here, before publishing.
    An update whose mini-batches held no token (every group filtered) took no step: nothing to check."""
    loss, norm = train["loss"], train["grad_norm"]
    losses = train.get("step_losses", [loss])
    if not losses:
        return
    if train["step_applied"] and all(math.isfinite(x) for x in losses) and math.isfinite(norm):
        return
    kept = f"its checkpoint at update {last_checkpoint}" if last_checkpoint else "no checkpoint yet"
    raise CheckFailed(
        f"update {update}: the loss ({loss}) or the gradient norm ({norm}) is not finite; the optimizer "
        f"step was skipped and nothing was published or saved (the run keeps {kept}). Check the "
        "reward function, the data and --lr"
    )


def save_stage(s: Session, next_update: int) -> float:
    """Checkpoint the run as of `next_update`. With `--async-save` the checkpoint is written in
    the background while the next update runs; its commit (tracker, the plan beside it) comes
    at the next save or the end of the run (Trainer.save)."""
    start = time.perf_counter()
    s.progress.stage(Stage("save", next_update))
    advanced = plans.advance(s.plan, next_update, s.cursor.state_dict(), s.options.updates)
    s.trainer.save(
        s.run.checkpoint,
        next_update,
        extra={"next_update": next_update, "cursor": s.cursor.state_dict()},
        before_commit=lambda staging: plans.write_plan(staging / s.run.plan.name, advanced) if s.is_main else None,
        after_commit=lambda _: plans.write_plan(s.run.plan, advanced) if s.is_main else None,
    )
    s.plan = advanced
    return time.perf_counter() - start


def evaluate_stage(s: Session, update: int, when: str) -> list[dict[str, Any]]:
    if not s.eval_rows:
        return []
    faults.point("evaluation")
    s.progress.stage(Stage("evaluation", update, when=when, depths=tuple(s.options.eval_depths), counter=s.generating))
    n, samples = min(s.options.eval_prompts, len(s.eval_rows)), s.options.eval_samples
    figures: dict[str, Any] = {}
    with phase(
        figures,
        "evaluation",
        s.trainer.device,
        f"{n} prompts{f' x {samples} samples' if samples > 1 else ''} at K = {s.options.eval_depths}",
        "--eval-prompts, --eval-samples or --max-num-seqs",
    ):
        results, responses = _evaluate(s, n, update)
    # the start's and an interval's figures go in the next metrics line (the end's in none)
    s.unlogged_evaluation = {"evaluation_when": when, **{k: v for k, v in figures.items() if "evaluation" in k}}
    if s.is_main:  # the responses first: an evaluations line is never there without its responses
        for r in responses:
            append_jsonl(s.run.responses, {"update": update, "when": when, **r})
        for r in results:
            append_jsonl(
                s.run.evaluations,
                {"update": update, "when": when, "weight_version": s.engine.get_weight_version(), **r},
            )
    return results


def _evaluate(s: Session, n: int, update: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    room_for_call(s, max(s.options.eval_depths), n * s.options.eval_samples, n)
    responses: list[dict[str, Any]] = []
    results = evaluate(
        s.engine,
        s.eval_rows[:n],
        s.eval_prompt_ids[:n],
        s.eval_sampling,
        ks=s.options.eval_depths,
        reward_fn=s.reward_fn,
        samples=s.options.eval_samples,
        responses=responses,
        where=f"evaluation at update {update}",
    )
    return results, responses


def _gather(samples: list[RolloutSample], update: int) -> list[dict[str, Any]]:
    """Every rank's records in global batch order (by `group`, the prompt's position; the
    sort is stable, so members keep their order): the same file whatever the rank count."""
    records = [r for part in _all_gather([x.record(update) for x in samples]) for r in part]
    return sorted(records, key=lambda r: r["group"])


def run_update(s: Session, update: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    k = depth_for_update(s.options.depths, update)
    counters_before = dict(s.engine.work_counters())
    take_batches = getattr(s.engine, "take_decode_batches", None)  # LLM's; other engines keep theirs
    if take_batches is not None:
        take_batches()  # from here on: this update's rollout and refills
    device, sizing, timing = s.trainer.device, s.sizing, {}
    # the optimizer state may share the device with a rollout's cache (rl/sizing.py state_per_call)
    lower = "--gpu-memory-utilization or --max-num-seqs" + (
        ", or pass --offload-optimizer on" if sizing.state_per_call else ""
    )
    s.progress.stage(Stage("rollout", update, k, counter=s.generating))
    with phase(
        timing,
        "rollout",
        device,
        f"update {update}, K={k}, up to {sizing.max_num_seqs} sequences in a "
        f"{sizing.kv_bytes / 2**30:.1f} GiB KV cache",
        lower,
    ):
        samples, plan_agreed = rollout_stage(s, update, k)
    decided = record_decisions(s)
    faults.point("rollout")
    score_stage(s, update, samples)
    if s.options.filter_groups:
        s.progress.stage(Stage("refill", update, k, counter=s.generating))
    with phase(
        timing,
        "refill",
        device,
        f"update {update}, refill rounds of up to {s.options.prompts_per_update} prompts",
        lower,
    ):
        trained, selection = refill_stage(s, update, k, samples)
    decided += record_decisions(s)  # the refill rounds' (rollout_stage decides in them too)
    batches = tenths(take_batches()) if take_batches is not None else None
    advantage_stage(s, samples)
    hand_back(s.engine, device)  # the trainer may use the KV cache's memory until the next rollout
    s.progress.stage(Stage("train", update, k, counter=getattr(s.trainer, "step_progress", None)))
    with phase(
        timing,
        "train",
        device,
        f"update {update}, {len(samples)} samples in micro-batches of up to "
        f"{sizing.max_tokens_per_micro_batch} tokens, recompute {'on' if sizing.recompute else 'off'}",
        "--max-tokens-per-micro-batch or --gpu-memory-utilization, or pass --recompute on",
    ):
        train = train_stage(s, update, samples, trained)
    decided += record_decisions(s)
    check_step(update, train, s.plan["next_update"])
    if sizing.gradients_released:
        s.trainer.release_gradients()  # dead until the next backward: the rollouts get their memory
    if device.type == "cuda":
        torch.cuda.empty_cache()  # activations freed: the KV cache is allocated whole again
    t_train = time.perf_counter()
    # hashing copies every parameter to the host: only worth it with replicas to compare
    ranks = _all_gather(
        {
            "param_sha256": params_sha256(s.trainer) if s.world > 1 else None,
            "samples": len(samples),
            "response_tokens": sum(len(x.response_ids) for x in samples),
            "rollout_s": timing["rollout_s"],
            "train_s": timing["train_s"],
            "device": str(s.trainer.device),
        }
    )
    identical = check_rank_params(update, [r["param_sha256"] for r in ranks])
    t_check = time.perf_counter()
    digest = state_digest(s.trainer) if s.options.state_digest else None
    s.progress.stage(Stage("publish", update, k))
    with phase(timing, "publish", device, f"update {update}, weights to the engine", "--gpu-memory-utilization"):
        publish(s.engine, s.trainer.named_weights_for_publication(), version=update + 2)
    records = _gather(samples, update)
    last = update + 1 == s.options.updates
    save_due = last or bool(s.options.save_interval and (update + 1) % s.options.save_interval == 0)
    interval: list[dict[str, Any]] = []
    if s.options.eval_interval and (update + 1) % s.options.eval_interval == 0 and not last:
        interval = evaluate_stage(s, update + 1, "interval")
    # the update's records are written before the save that includes it (records.py): its row
    # carries the previous save's figures
    save, s.unlogged_save = s.unlogged_save, dict(NO_SAVE)
    evaluation, s.unlogged_evaluation = s.unlogged_evaluation, {}
    elapsed = time.perf_counter() - s.started
    engine_delta = counter_delta(dict(s.engine.work_counters()), counters_before)
    if engine_delta.get("spec_draft_tokens"):
        engine_delta["spec_acceptance_rate"] = engine_delta["spec_accepted_tokens"] / engine_delta["spec_draft_tokens"]
    record = {
        "update": update,
        "k": k,
        "weight_version": samples[0].weight_version,
        "config_hash": samples[0].config_hash,
        "ranks": s.world,
        "plan_agreed_ranks": plan_agreed,
        "params_identical_across_ranks": identical,
        **{f"rank_{key}": [r[key] for r in ranks] for key in ranks[0]},
        "rank_check_s": t_check - t_train,
        "state_sha256": digest,
        **rollout_summary(records),
        **selection,
        "memory_decisions": decided,
        **{f"train_{key}": value for key, value in train.items()},
        "logprob_mismatch_mean": train.get("logprob_mismatch_mean"),
        "logprob_mismatch_max": train.get("logprob_mismatch_max"),
        "logprob_mismatch_mean_by_depth": train.get("logprob_mismatch_mean_by_depth"),
        "logprob_mismatch_max_by_depth": train.get("logprob_mismatch_max_by_depth"),
        **timing,
        "compile_s": sum(v for key, v in timing.items() if key.endswith("_compile_s")),
        **evaluation,
        **save,
        "step_s": time.perf_counter() - t0 + save["save_s"],
        "job_elapsed_s": elapsed,
        "device_hours": device_hours(elapsed, s.devices) * s.world,
        "kv_transport": getattr(s.engine, "transport", None),
        "engine_decode_batch_tenths": batches,
        **{f"engine_{key}": v for key, v in engine_delta.items()},
    }
    if s.is_main:
        run_records.write_update(s.run, update, records, record, durable=save_due)
        s.trackers.update(record)
        s.trackers.evaluations(update + 1, interval)  # after the update's line: trackers want steps in order
    s.progress.updated(record)
    if interval:
        s.progress.evaluated(update + 1, "interval", interval)
    if save_due:
        with phase(s.unlogged_save, "save", device, f"checkpoint of update {update + 1}", "--gpu-memory-utilization"):
            save_stage(s, update + 1)
    return record


# ---- the whole job -------------------------------------------------------------------


def check_run_dir(run: RunDir, options: TrainOptions, *, resuming: bool = False) -> None:
    """The output guard (ouro_cli/outputs.py) for a run: the run directory lies outside the model,
    the data and the eval data and outside any other run's own files, and is writable (whether
    it may hold something is `prepare_run_dir`'s to say). --export-hf lies outside those inputs,
    the checkpoint and this run's own files, and is empty unless it may be replaced
    (`_export_replaceable`)."""
    inputs = [options.model, options.data, *([options.eval_data] if options.eval_data else [])]
    check_output(run.root, overwrite=True, inputs=inputs, what="run directory")
    if options.export_hf:
        check_output(
            Path(options.export_hf),
            overwrite=_export_replaceable(run, options),
            inputs=[*inputs, run.checkpoint],
            runs=[run],
            what="--export-hf",
            hint="remove it" if resuming else "pass --overwrite",
        )


def _export_replaceable(run: RunDir, options: TrainOptions) -> bool:
    """Whether the run may replace what --export-hf holds: with --overwrite (`ouro train`), or
    when it is an export of this same run (a resume to more updates exports again)."""
    out = Path(options.export_hf)
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        source = Path(manifest["options"]["source"])
        own = manifest["command"].endswith("--export-hf") and source.resolve() == run.checkpoint.resolve()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        own = False
    return options.overwrite or (own and is_complete(out))


def export_stage(run: RunDir, options: TrainOptions, command: str, log: Callable[[str], None]) -> Path:
    """The final model as an HF directory at --export-hf, through the output guard (rank 0)."""
    from ouro_cli.checkpoint import open_checkpoint
    from ouro_cli.checkpoint.convert import to_hf

    out = Path(options.export_hf)
    to_hf(
        open_checkpoint(run.checkpoint),
        out,
        overwrite=_export_replaceable(run, options),
        command=f"{command} --export-hf",
        options={"source": str(run.checkpoint.resolve())},
    )
    log(f"exported the final model to {out}")
    return out


def prepare_run_dir(run: RunDir, overwrite: bool, log: Callable[[str], None] = lambda s: None) -> None:
    """Make `run` an empty run directory (the caller holds its lock; `check_run_dir` ran first,
    so no input lies inside it). `--overwrite` empties it; a run that never committed a
    checkpoint is started again without it (nothing of value is lost: a resume would start
    it from update 0 too); a run with checkpoints, or any other content, is refused."""
    run.root.mkdir(parents=True, exist_ok=True)
    if is_empty_dir(run.root, ignore=[run.lock.name]):
        return
    if not overwrite:
        if run.has_checkpoint():
            raise UserError(
                f"run directory {run.root} holds a run with checkpoints; continue it with "
                f"`ouro resume {run.root} --updates N`, or pass --overwrite to start over"
            )
        foreign = run.foreign_entries()
        if foreign or not (run.is_run() or run.manifest.is_file() or run.checkpoint.is_dir()):
            shown = f" ({foreign[0]})" if foreign else ""
            raise UserError(
                f"run directory {run.root} is not empty{shown} and is not an ouro run; choose another "
                "or pass --overwrite"
            )
        log(f"{run.root} holds a run that never saved a checkpoint: starting it again")
    clear_dir(run.root, keep=[run.lock.name])


def _stop_if_asked(s: Session, stop: StopSignals, done: int, hint: str) -> None:
    """Between updates: end the run when any rank received SIGINT or SIGTERM, saving first
    when --save-on-interrupt says so (stop.py)."""
    signums = [x for x in _all_gather(stop.signum) if x is not None]
    if not signums:
        return
    last = s.plan["next_update"]
    o = s.options
    if wants_save(
        o.save_on_interrupt, done=done, last_checkpoint=last, save_interval=o.save_interval, updates=o.updates
    ):
        if s.is_main:
            run_records.sync_update(s.run, done - 1)
        save_stage(s, done)
        state = f"checkpoint saved at update {done}"
    elif last == done and last:
        state = f"its checkpoint is at update {done}"
    elif last:
        state = f"not saved: the resume repeats updates {last}-{done - 1} from the checkpoint at update {last}"
    else:
        state = "no checkpoint yet: the resume starts it again"
    where = f"after update {done - 1}" if done else "before its first update"
    raise Interrupted(f"stopped by {signal_name(signums[0])} {where} ({state}); continue with: {hint}", signums[0])


def train(
    options: TrainOptions,
    run: RunDir,
    *,
    resume: bool = False,
    override_scheduler: bool = False,
    log: Callable[[str], None] = lambda s: None,
    progress: RunProgress | None = None,
    command: str = "ouro train",
) -> dict[str, Any]:
    """The whole job (the caller holds the run lock). A resume first checks the records against
    the checkpoint (records.py); a resume of a run that never saved a checkpoint starts it again.
    `progress` is told what the run does as it does it (rl/progress.py)."""
    continuing = resume
    start = run_records.resume_point(run, options.updates, log) if resume else None
    if resume and start is None:
        log(f"{run.root} never saved a checkpoint: starting it again from update 0")
        resume = False
    hint = f"ouro resume {run.root} --updates {options.updates}"
    state = f"its checkpoint is at update {start}" if start else "no checkpoint yet: the resume starts it again"
    with StopSignals(log, hint, at_once=f"before its first update ({state})") as stop:
        session = setup(options, run, resume=resume, override_scheduler=override_scheduler, log=log, progress=progress)
        return _train(session, stop, continuing=continuing, hint=hint, log=log, command=command)


def _train(
    session: Session,
    stop: StopSignals,
    *,
    continuing: bool,
    hint: str,
    log: Callable[[str], None],
    command: str,
) -> dict[str, Any]:
    options, run = session.options, session.run
    faulted = False
    try:
        if session.is_main:
            (run.root / "COMPLETE").unlink(missing_ok=True)
            effective = options.execution.effective(session.trainer.device.type)  # what the kernels are here
            write_manifest(run.root, command, {**options.to_dict(), "execution": effective}, [Path(options.data)])
            if continuing:  # updates logged after the checkpoint (a crash) run again
                if session.start_update:
                    run_records.repair_tracker(run, log)
                run_records.drop_after(
                    run, session.start_update, finishing=session.start_update == options.updates, log=log
                )
                plans.write_plan(run.plan, session.plan)  # the checkpoint's: a kill may have come before the copy
        evals_before = evaluate_stage(session, session.start_update, "start") if session.start_update == 0 else []
        session.trackers.evaluations(session.start_update, evals_before)
        if evals_before:
            session.progress.evaluated(session.start_update, "start", evals_before)
        stop.begin_updates()
        records = []
        for update in range(session.start_update, options.updates):
            _stop_if_asked(session, stop, update, hint)
            records.append(run_update(session, update))
        _stop_if_asked(session, stop, options.updates, hint)
        evals_after = evaluate_stage(session, options.updates, "end")
        session.trackers.evaluations(options.updates, evals_after)
        if evals_after:
            session.progress.evaluated(options.updates, "end", evals_after)
        waited = time.perf_counter()
        session.trainer.wait_for_save()  # a background save commits before the run can be complete
        session.unlogged_save["save_s"] += time.perf_counter() - waited
        final_save = dict(session.unlogged_save)  # no update's line follows it (metrics.py)
        if session.is_main:
            if options.export_hf:
                session.progress.stage(Stage("export"))
                export_stage(run, options, command, log)
            if options.plot and plot_run(run.metrics, run.evaluations, run.plot) is None:
                log(f"{run.plot.name} not written (matplotlib is not installed)")
            mark_complete(run.root, {"final_save": final_save})
        return {
            "run_dir": str(run.root),
            "updates": options.updates,
            "start_update": session.start_update,
            "export_hf": options.export_hf or None,
            "last_weight_version": session.engine.get_weight_version(),
            "evaluations_before": evals_before,
            "evaluations_after": evals_after,
            "reward_mean_per_update": [r["reward_mean"] for r in records],
            "final_save_s": final_save["save_s"],
            "final_save": final_save,
        }
    except BaseException as err:
        faulted = is_device_fault(err)
        raise
    finally:
        session.trackers.close()
        if not faulted:  # a lost CUDA context fails every further call, and would hide the error
            session.engine.close()
            session.trainer.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
