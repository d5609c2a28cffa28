"""`ouro train` and `ouro resume`: the GRPO loop (ouro_cli.rl.loop) from the command line.

Every flag defaults to None here so that a TOML `--config` file can set it and a flag
given on the command line overrides it; the defaults themselves live in
`ouro_cli.rl.options.TrainOptions`, and the help shows them from there (`_opt`). Both
commands hold the run directory's lock (ouro_cli.rl.lock) for as long as they work in it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from .common import JSON_OPTION, console, hidden_alias, is_main_rank, run_command

TRAIN_EPILOG = """Examples:

  ouro train --depths 2 3 4                       # bundled tiny model and data, 80 updates

  ouro train --model ./Ouro-1.4B --data train.jsonl --run-dir runs/grpo-1 --depths 2 3 4 --updates 200 \\
      --prompts-per-update 64 --group-size 8 --max-response-len 2048 --reward-function ouro_cli.rl.rewards.math_answer

  ouro train --model ./Ouro-1.4B --data deepscaler.parquet \\
      --label-key reward_model.ground_truth --id-key extra_info.index \\
      --eval-data math500.parquet --eval-prompt-key problem \\
      --eval-label-key answer --eval-id-key unique_id \\
      --reward-function ouro_cli.rl.rewards.math_answer     # verl Parquet

  ouro train --config recipe.toml --updates 50    # flags override the TOML file
"""

RESUME_EPILOG = """Examples:

  ouro resume runs/grpo-1 --updates 400

  ouro resume runs/grpo-1 --updates 400 --lr 5e-7 --override-scheduler
"""

P_DATA, P_GRPO, P_OPT, P_ENGINE, P_RUN = "Model and data", "GRPO update", "Optimizer", "Engine", "Run, save, evaluate"


# How the help shows a default that TrainOptions holds as None, a path or a list.
_DEFAULT_TEXT = {"config": "none", "export_hf": "none", "max_position_embeddings": "the model's",
                 "prefill_devices": "none", "decode_devices": "none"}


_STATED_DEFAULT = re.compile(r" ?\(default: ((?:[^()]|\([^()]*\))*)\)")


def _default_text(field: str) -> str:
    from ouro_cli.rl.options import TrainOptions

    if field in _DEFAULT_TEXT:
        return _DEFAULT_TEXT[field]
    value = getattr(TrainOptions(), field)
    if isinstance(value, bool):
        return "on" if value else "off"
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _opt(*names: str, help: str, panel: str, default: str | None = None, **kw: Any):
    """A train/resume option. The first name is shown, further names are hidden aliases (so
    that the help's option column fits 80 columns); the default comes from TrainOptions (the
    field one of the names spells) unless the help states it in words or `default` says it."""
    from ouro_cli.rl.options import option_names

    shown, *aliases = names
    for alias in aliases:
        hidden_alias(alias, shown.split("/")[0])
    stated = _STATED_DEFAULT.search(help)
    if stated:  # a default stated in words is shown like a computed one
        help = help[:stated.start()] + help[stated.end():]
    if default is None:
        spelled = [n.split("/")[0].removeprefix("--").replace("-", "_") for n in names]
        default = stated.group(1) if stated else _default_text(
            next(f for f in spelled if f in _DEFAULT_TEXT or f in option_names()))
    return typer.Option(shown, help=f"{help} \\[default: {default}]", rich_help_panel=panel, show_default=False,
                        **kw)


def _kept(*names: str, help: str, panel: str, **kw: Any):
    """A resume option whose default is the run's own value (from its ouro-plan.json)."""
    return _opt(*names, help=help, panel=panel, default="the run's", **kw)


def train(
    config: Annotated[Path | None, _opt("--config", help="TOML file with any of these options (flags override it).", panel=P_DATA)] = None,
    model: Annotated[str | None, _opt("--model", help="HF directory or Megatron checkpoint to start from (default: bundled tiny model).", panel=P_DATA)] = None,
    data: Annotated[str | None, _opt("--data", help="Training data: JSONL, Parquet, or a datasets save_to_disk directory (default: bundled).", panel=P_DATA)] = None,
    prompt_key: Annotated[str | None, _opt("--prompt-key", help="Field of a --data row holding the prompt; dots reach into nested fields.", panel=P_DATA)] = None,
    label_key: Annotated[str | None, _opt("--label-key", help="Field holding the label, e.g. answer or reward_model.ground_truth.", panel=P_DATA)] = None,
    id_key: Annotated[str | None, _opt("--id-key", help="Field holding the problem id (a row without one: its index).", panel=P_DATA)] = None,
    label_parser: Annotated[str | None, _opt("--label-parser", help="none, or gsm8k: the label is the number after '####' in GSM8K's answer text.", panel=P_DATA)] = None,
    prompt_template: Annotated[str | None, _opt("--prompt-template", help="chatml (default), raw, or tokenizer (the model's chat template).", panel=P_DATA)] = None,
    reward_function: Annotated[str | None, _opt("--reward-function", "--ouro-reward-function", help="Dotted path of f(response, label) -> float (default: ouro_cli.rl.rewards.boxed_answer).", panel=P_DATA)] = None,
    depths: Annotated[list[int] | None, _opt("--depths", "--ouro-depths", help="Decode budget K per update, cycled: --depths 2 3 4.", panel=P_GRPO)] = None,
    updates: Annotated[int | None, _opt("--updates", help="Number of GRPO updates (default: 80).", panel=P_GRPO)] = None,
    prompts_per_update: Annotated[int | None, _opt("--prompts-per-update", help="Prompts per update (global) (default: 16).", panel=P_GRPO)] = None,
    group_size: Annotated[int | None, _opt("--group-size", help="Samples per prompt (default: 8).", panel=P_GRPO)] = None,
    temperature: Annotated[float | None, _opt("--temperature", help="Sampling temperature (default: 1.0).", panel=P_GRPO)] = None,
    max_response_len: Annotated[int | None, _opt("--max-response-len", "--rollout-max-response-len", help="Tokens per response (default: 48).", panel=P_GRPO)] = None,
    seq_length: Annotated[int | None, _opt("--seq-length", help="Prompt + response token limit (default: the model's).", panel=P_GRPO)] = None,
    max_position_embeddings: Annotated[int | None, _opt("--max-position-embeddings", help="Must equal the model's value when given.", panel=P_GRPO)] = None,
    exit_threshold: Annotated[float | None, _opt("--exit-threshold", "--ouro-exit-threshold", help="Native early exit at CDF >= threshold (1 = exactly K loops).", panel=P_GRPO)] = None,
    min_loops: Annotated[int | None, _opt("--min-loops", help="Fewest loops a decoded token runs (default: 1).", panel=P_GRPO)] = None,
    seed: Annotated[int | None, _opt("--seed", help="Run seed: data order, sampling, init (default: 1234).", panel=P_GRPO)] = None,
    lr: Annotated[float | None, _opt("--lr", help="Learning rate (default: 1e-4, tuned for the bundled tiny model).", panel=P_OPT)] = None,
    lr_schedule: Annotated[str | None, _opt("--lr-schedule", help="constant or cosine.", panel=P_OPT)] = None,
    warmup_steps: Annotated[int | None, _opt("--warmup-steps", help="LR warmup updates.", panel=P_OPT)] = None,
    clip_grad: Annotated[float | None, _opt("--clip-grad", help="Gradient-norm clip (0 = off) (default: 1.0).", panel=P_OPT)] = None,
    eps_low: Annotated[float | None, _opt("--eps-low", help="Ratio clip below 1 (default: 0.2).", panel=P_OPT)] = None,
    eps_high: Annotated[float | None, _opt("--eps-high", help="Ratio clip above 1 (default: 0.28).", panel=P_OPT)] = None,
    aggregation: Annotated[str | None, _opt("--aggregation", help="token_mean (default) or sequence_mean.", panel=P_OPT)] = None,
    max_tokens_per_micro_batch: Annotated[int | None, _opt("--max-tokens-per-micro-batch", help="Tokens per training micro-batch, padding included (default: what fits in the memory left).", panel=P_OPT)] = None,
    micro_batch_size: Annotated[int | None, _opt("--micro-batch-size", help="At most this many samples per micro-batch (default: no limit beside the token budget).", panel=P_OPT)] = None,
    recompute: Annotated[str | None, _opt("--recompute", help="Activation recompute per layer call: auto (on only when the memory budget needs it), on or off (default: auto).", panel=P_OPT)] = None,
    offload_optimizer: Annotated[bool | None, _opt("--offload-optimizer", help="Keep the fp32 main weights and Adam moments in host memory between optimizer steps (frees 12 bytes per parameter on the device for two host copies of them per step).", panel=P_OPT)] = None,
    use_distributed_optimizer: Annotated[bool | None, _opt("--dist-optimizer", "--use-distributed-optimizer", help="Shard optimizer state over data-parallel ranks.", panel=P_OPT)] = None,
    engine: Annotated[str | None, _opt("--engine", help="Dotted path of an engine factory (default: the built-in engine).", panel=P_ENGINE)] = None,
    device: Annotated[str | None, _opt("--device", help="auto, cpu or cuda.", panel=P_ENGINE)] = None,
    dtype: Annotated[str | None, _opt("--dtype", help="auto (bf16 on CUDA, fp32 on CPU), fp32 or bf16.", panel=P_ENGINE)] = None,
    gpu_memory_utilization: Annotated[float | None, _opt("--gpu-memory-utilization", help="Fraction of device memory the run may fill, trainer included; host memory on CPU (default: 0.9).", panel=P_ENGINE)] = None,
    max_num_seqs: Annotated[int | None, _opt("--max-num-seqs", "--ouro-max-num-seqs", help="Cap on sequences decoded together (default: as many as a rollout submits, up to 512; the KV cache limits what runs at once).", panel=P_ENGINE)] = None,
    kv_blocks: Annotated[int | None, _opt("--kv-blocks", "--ouro-kv-blocks", help="Paged KV blocks of T planes per layer (default: sized from --gpu-memory-utilization).", panel=P_ENGINE)] = None,
    block_size: Annotated[int | None, _opt("--block-size", help="Tokens per KV block (default: 16).", panel=P_ENGINE)] = None,
    cuda_graphs: Annotated[bool | None, _opt("--cuda-graphs", "--ouro-cuda-graphs", help="Require CUDA-graph decode steps (on by default on CUDA; an error without a GPU).", panel=P_ENGINE)] = None,
    async_scheduling: Annotated[bool | None, _opt("--async-scheduling", "--ouro-async-scheduling", help="Queue each decode loop before reading the last exit signal (forces delayed exits).", panel=P_ENGINE)] = None,
    speculative_tokens: Annotated[int | None, _opt("--speculative-tokens", "--ouro-speculative-tokens", help="Self-speculation: draft N tokens at 2 loops, verify at T (needs --depths T alone).", panel=P_ENGINE)] = None,
    prefill_devices: Annotated[list[int] | None, _opt("--prefill-devices", "--ouro-prefill-devices", help="Prefill worker devices (PD disaggregation; CPU: worker processes).", panel=P_ENGINE)] = None,
    decode_devices: Annotated[list[int] | None, _opt("--decode-devices", "--ouro-decode-devices", help="Decode worker devices (PD disaggregation).", panel=P_ENGINE)] = None,
    run_dir: Annotated[str | None, _opt("--run-dir", help="Run directory (default: runs/ouro-<timestamp>).", panel=P_RUN)] = None,
    save_interval: Annotated[int | None, _opt("--save-interval", help="Checkpoint every N updates, and always at the end (default: 20; 0 = end only).", panel=P_RUN)] = None,
    keep_last: Annotated[int | None, _opt("--keep-last", help="Checkpoint iterations to keep (default: 2).", panel=P_RUN)] = None,
    async_save: Annotated[bool | None, _opt("--async-save/--sync-save", help="Write checkpoints in the background while the next update runs; the next save and the end of the run wait for it.", panel=P_RUN)] = None,
    eval_data: Annotated[str | None, _opt("--eval-data", "--ouro-eval-data", help="Held-out data: JSONL, Parquet or a datasets directory (default: bundled).", panel=P_RUN)] = None,
    eval_prompt_key: Annotated[str | None, _opt("--eval-prompt-key", help="--prompt-key of --eval-data (default: --prompt-key's).", panel=P_RUN)] = None,
    eval_label_key: Annotated[str | None, _opt("--eval-label-key", help="--label-key of --eval-data (default: --label-key's).", panel=P_RUN)] = None,
    eval_id_key: Annotated[str | None, _opt("--eval-id-key", help="--id-key of --eval-data (default: --id-key's).", panel=P_RUN)] = None,
    eval_label_parser: Annotated[str | None, _opt("--eval-label-parser", help="--label-parser of --eval-data (default: --label-parser's).", panel=P_RUN)] = None,
    eval_prompts: Annotated[int | None, _opt("--eval-prompts", "--ouro-eval-prompts", help="Held-out prompts per evaluation (default: 200).", panel=P_RUN)] = None,
    eval_interval: Annotated[int | None, _opt("--eval-interval", "--ouro-eval-interval", help="Evaluate every N updates (always at start and end).", panel=P_RUN)] = None,
    eval_depths: Annotated[list[int] | None, _opt("--eval-depths", help="K values evaluated (default: 2 3 4).", panel=P_RUN)] = None,
    export_hf: Annotated[str | None, _opt("--export-hf", "--ouro-export-hf", help="Export the final model as an HF directory here.", panel=P_RUN)] = None,
    overwrite: Annotated[bool | None, _opt("--overwrite", help="Start over in a non-empty run directory.", panel=P_RUN)] = None,
    loggers: Annotated[list[str] | None, _opt("--logger", help="Also log to tensorboard (RUN/logs/tensorboard) or wandb (the wandb extra; WANDB_MODE=offline works); repeat for both.", panel=P_RUN, default="none")] = None,
    state_digest: Annotated[bool | None, _opt("--state-digest", help="Record a sha256 of model + optimizer state per update.", panel=P_RUN)] = None,
    save_on_interrupt: Annotated[str | None, _opt("--save-on-interrupt", help="On SIGINT/SIGTERM, save before stopping: on, off, or auto (when a checkpoint is due within 3 updates).", panel=P_RUN)] = None,
    test_break_resume: Annotated[bool | None, typer.Option("--test-break-resume", hidden=True)] = None,
    json_output: bool = JSON_OPTION,
) -> None:
    """Run GRPO on an Ouro model: rollouts at per-update depth budgets, Megatron-core updates."""
    params = dict(locals())

    def body() -> dict[str, Any]:
        from ouro_cli.rl.run_dir import RunDir

        options = resolve_params(params)
        if options.run_dir is None:
            options.run_dir = f"runs/ouro-{time.strftime('%Y%m%d-%H%M%S')}"
        run = RunDir(Path(options.run_dir))
        from ouro_cli.rl.lock import RunLock
        from ouro_cli.rl.loop import check_run_dir, prepare_run_dir

        check_run_dir(run, options)
        with RunLock(run.root, "ouro train", log=_note):
            if is_main_rank():  # under torchrun the other ranks are the same job
                prepare_run_dir(run, options.overwrite, log=_note)
            return _run(options, run, resume=False, override_scheduler=False, json_output=json_output,
                        command="ouro train")

    run_command(_quiet(body), json_output=json_output)


def resolve_params(params: dict[str, Any]):
    """TrainOptions from `ouro train`'s parameters: the flags given, over the --config file, over
    the defaults (verify-resume resolves the arguments it forwards the same way)."""
    from ouro_cli.rl.options import resolve

    config = params.get("config")
    flags = {k: (v or None) if isinstance(v, list) else v for k, v in params.items() if k not in ("config", "json_output")}
    return resolve(flags, str(config) if config else None)


def resume(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by ouro train.", show_default=False)],
    updates: Annotated[int, typer.Option("--updates", help="Total updates to reach (more than the run has).")],
    override_opt_param_scheduler: Annotated[bool, _opt("--override-scheduler", "--override-opt-param-scheduler", help="Allow a new LR schedule (lr, lr-schedule, warmup, min-lr).", panel=P_OPT, default="off")] = False,
    depths: Annotated[list[int] | None, _kept("--depths", "--ouro-depths", help="Must equal the run's (checked).", panel=P_GRPO)] = None,
    lr: Annotated[float | None, _kept("--lr", help="New LR (needs --override-scheduler).", panel=P_OPT)] = None,
    seed: Annotated[int | None, _kept("--seed", help="Must equal the run's (checked).", panel=P_GRPO)] = None,
    temperature: Annotated[float | None, _kept("--temperature", help="Must equal the run's (checked).", panel=P_GRPO)] = None,
    group_size: Annotated[int | None, _kept("--group-size", help="Must equal the run's (checked).", panel=P_GRPO)] = None,
    prompts_per_update: Annotated[int | None, _kept("--prompts-per-update", help="Must equal the run's (checked).", panel=P_GRPO)] = None,
    max_num_seqs: Annotated[int | None, _kept("--max-num-seqs", "--ouro-max-num-seqs", help="Must equal the run's (checked).", panel=P_ENGINE)] = None,
    eval_interval: Annotated[int | None, _kept("--eval-interval", "--ouro-eval-interval", help="Evaluate every N updates.", panel=P_RUN)] = None,
    save_interval: Annotated[int | None, _kept("--save-interval", help="Checkpoint every N updates.", panel=P_RUN)] = None,
    export_hf: Annotated[str | None, _kept("--export-hf", "--ouro-export-hf", help="Export the final model here.", panel=P_RUN)] = None,
    save_on_interrupt: Annotated[str | None, _kept("--save-on-interrupt", help="On SIGINT/SIGTERM, save before stopping: on, off or auto.", panel=P_RUN)] = None,
    async_save: Annotated[bool | None, _kept("--async-save/--sync-save", help="Write checkpoints in the background.", panel=P_RUN)] = None,
    json_output: bool = JSON_OPTION,
) -> None:
    """Continue a run from its latest checkpoint, holding it to its plan (ouro-plan.json)."""
    given = {"depths": depths or None, "lr": lr, "seed": seed, "temperature": temperature, "group_size": group_size,
             "prompts_per_update": prompts_per_update, "max_num_seqs": max_num_seqs, "eval_interval": eval_interval,
             "save_interval": save_interval, "export_hf": export_hf, "save_on_interrupt": save_on_interrupt,
             "async_save": async_save}

    def body() -> dict[str, Any]:
        from ouro_cli.rl import plan as plans
        from ouro_cli.rl.lock import RunLock
        from ouro_cli.rl.loop import check_run_dir
        from ouro_cli.rl.options import TrainOptions
        from ouro_cli.rl.run_dir import RunDir

        run = RunDir(run_dir)
        plans.read_plan(run.plan)  # not a run: say so before anything else
        with RunLock(run.root, "ouro resume", create=False, log=_note):
            saved = plans.read_plan(run.plan)
            values = {**saved["options"], **{k: v for k, v in given.items() if v is not None}}
            values.update(updates=updates, run_dir=str(run_dir), overwrite=False)
            options = TrainOptions(**values).validate()
            check_run_dir(run, options)
            return _run(options, run, resume=True, override_scheduler=override_opt_param_scheduler,
                        json_output=json_output, command="ouro resume")

    run_command(_quiet(body), json_output=json_output)


def _quiet(body: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """`body` with third-party warnings sent to the run's logs/warnings.log (_run names it)."""
    from ouro_cli.warnings_log import quiet

    return quiet(body, lambda line: console.print(f"[dim]{line}[/]"))


def _note(message: str) -> None:
    console.print(f"[dim]{escape(message)}[/]")


def _run(options, run, *, resume: bool, override_scheduler: bool, json_output: bool, command: str) -> dict[str, Any]:
    from ouro_cli.warnings_log import attach_active

    main_rank = int(os.environ.get("RANK", "0")) == 0
    started = time.time()

    def working() -> bool:  # this command wrote the run's manifest: its checks passed, it is working in RUN
        import json

        try:
            return json.loads(run.manifest.read_text())["created_unix"] >= started
        except (OSError, ValueError, KeyError):
            return False

    attach_active(run.warnings_log, ready=working, keep=main_rank)
    if not main_rank:  # under torchrun, rank 0 speaks for the job
        console.quiet = True
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ouro_cli.rl.loop import train as train_loop

    columns = (TextColumn("[bold]GRPO[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("setting up", total=options.updates)

        def on_update(record: dict[str, Any]) -> None:
            progress.update(task, completed=record["update"] + 1,
                            description=f"K={record['k']} reward={record['reward_mean']:.3f} step={record['step_s']:.1f}s")
            if not console.is_terminal:
                console.print(f"update {record['update']}: K={record['k']} v{record['weight_version']} "
                              f"reward={record['reward_mean']:.3f} step={record['step_s']:.2f}s")

        summary = train_loop(options, run, resume=resume, override_scheduler=override_scheduler,
                             log=_note, on_update=on_update, command=command)
    _print_evaluations(summary)
    console.print(f"run directory: {summary['run_dir']}")
    return summary


def _print_evaluations(summary: dict[str, Any]) -> None:
    from rich.table import Table

    before = {e["k"]: e for e in summary["evaluations_before"]}
    after = summary["evaluations_after"]
    if not after:
        return
    table = Table(title="held-out accuracy")
    for col in ("K", "before", "after", "mean exit depth", "mean tokens"):
        table.add_column(col, justify="right")
    for e in after:
        b = before.get(e["k"])
        table.add_row(str(e["k"]), f"{b['accuracy']:.3f}" if b else "-", f"{e['accuracy']:.3f}",
                      f"{e['mean_exit_depth']:.2f}", f"{e['mean_tokens']:.1f}")
    console.print(table)
