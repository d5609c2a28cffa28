"""`ouro train` and `ouro resume`: the GRPO loop (ouro_cli.rl.loop) from the command line.

Their flags are the options of `ouro_cli.rl.options.TrainOptions`, built from its fields
(cli/options.py): the help line, the panel and the default are the field's. Every flag
defaults to None here, so that a TOML `--config` file can set it and a flag given on the
command line overrides it; `ouro resume` takes a few of them, which its plan checks. Both
commands hold the run directory's lock (ouro_cli.rl.lock) for as long as they work in it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from ouro_cli.config import P_DATA, P_OPT
from ouro_cli.errors import UserError

from .common import console, hidden_alias, is_main_rank, report_console, run_command
from .options import by_panel, json_parameter, parameters, with_options

TRAIN_EPILOG = """Examples:

  ouro train --depths 2 3 4                       # bundled tiny model and data, 80 updates

  ouro train --model ./Ouro-1.4B-Thinking --data train.jsonl --run-dir runs/grpo-1 --updates 200 \\
      --prompts-per-update 64 --lr 1e-6 --max-response-len 2048 --reward-function ouro_cli.rl.rewards.math_answer

  ouro train --config examples/ouro-1.4b/recipe.toml --dry-run   # data, options and memory plan; no weights read

  ouro train --config examples/ouro-1.4b/recipe.toml --dry-run --dry-run-gpu 141   # the plan for an H200, from a laptop

  ouro train --model ./Ouro-1.4B --data deepscaler.parquet \\
      --label-key reward_model.ground_truth --id-key extra_info.index \\
      --eval-data math500.parquet --eval-prompt-key problem \\
      --eval-label-key answer --eval-id-key unique_id \\
      --reward-function ouro_cli.rl.rewards.math_answer     # verl Parquet

  ouro train --config recipe.toml --updates 50    # flags override the TOML file

  ouro train --config recipe.toml --kv-cache-dtype fp8   # fp8 K/V: about 1.8x the KV tokens, rounded in the replay too
"""

RESUME_EPILOG = """Examples:

  ouro resume runs/grpo-1 --updates 400

  ouro resume runs/grpo-1 --updates 400 --lr 5e-7 --override-scheduler
"""


def _verbose_parameter() -> inspect.Parameter:
    return inspect.Parameter(
        "verbose",
        inspect.Parameter.KEYWORD_ONLY,
        default=False,
        annotation=Annotated[
            bool,
            typer.Option(
                "--verbose",
                help="Also log the execution plan's hash and the weight versions. \\[default: off]",
                show_default=False,
            ),
        ],
    )


def _train(
    config: Path | None, dry: bool, dry_gpu: float | None, json_output: bool, verbose: bool, **flags: Any
) -> None:
    """Run GRPO on an Ouro model: rollouts at per-update depth budgets, Megatron-core updates."""
    params = {"config": config, **flags}

    def body() -> dict[str, Any]:
        from ouro_cli.rl.run_dir import RunDir

        options = resolve_params(params)
        for choice in options.chosen:
            console.print(escape(choice.note), soft_wrap=True)
        if dry_gpu is not None and not dry:
            raise UserError("--dry-run-gpu sizes a dry run's plan: pass --dry-run with it")
        if dry:
            return _dry_run(options, json_output, dry_gpu)
        if options.run_dir is None:
            options.run_dir = f"runs/ouro-{time.strftime('%Y%m%d-%H%M%S')}"
        run = RunDir(Path(options.run_dir))
        from ouro_cli.rl.lock import RunLock
        from ouro_cli.rl.loop import check_run_dir, prepare_run_dir

        check_run_dir(run, options)
        with RunLock(run.root, "ouro train", log=_note):
            if is_main_rank():  # under torchrun the other ranks are the same job
                prepare_run_dir(run, options.overwrite, log=_note)
            return _run(
                options,
                run,
                resume=False,
                override_scheduler=False,
                json_output=json_output,
                verbose=verbose,
                command="ouro train",
            )

    run_command(_quiet(body), json_output=json_output)


def resolve_params(params: dict[str, Any]):
    """TrainOptions from `ouro train`'s parameters: the flags given, over the --config file, over
    the defaults (verify-resume resolves the arguments it forwards the same way)."""
    from ouro_cli.rl.options import resolve

    config = params.get("config")
    # a list option not given is empty: a list from typer, a tuple from click's own parsing (verify-resume)
    flags = {
        k: (list(v) or None) if isinstance(v, list | tuple) else v
        for k, v in params.items()
        if k not in ("config", "dry", "dry_gpu", "json_output", "verbose")
    }
    return resolve(flags, str(config) if config else None)


def _resume(
    run_dir: Path, updates: int, override_opt_param_scheduler: bool, json_output: bool, verbose: bool, **flags: Any
) -> None:
    """Continue a run from its latest checkpoint, holding it to its plan (ouro-plan.json)."""
    given = {k: (v or None) if isinstance(v, list) else v for k, v in flags.items()}

    def body() -> dict[str, Any]:
        from ouro_cli.rl import plan as plans
        from ouro_cli.rl.lock import RunLock
        from ouro_cli.rl.loop import check_run_dir
        from ouro_cli.rl.run_dir import RunDir

        run = RunDir(run_dir)
        plans.read_plan(run.plan)  # not a run: say so before anything else
        with RunLock(run.root, "ouro resume", create=False, log=_note):
            options = plans.resume_options(plans.read_plan(run.plan), given, updates=updates, run_dir=str(run_dir))
            check_run_dir(run, options, resuming=True)
            return _run(
                options,
                run,
                resume=True,
                override_scheduler=override_opt_param_scheduler,
                json_output=json_output,
                verbose=verbose,
                command="ouro resume",
            )

    run_command(_quiet(body), json_output=json_output)


DRY_RUN = inspect.Parameter(
    "dry",
    inspect.Parameter.KEYWORD_ONLY,
    default=False,
    annotation=Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Check the data, resolve every option and size the memory plan from the model's config and "
            "this device, print them and exit; no weights are read, nothing is written. \\[default: off]",
            show_default=False,
        ),
    ],
)
DRY_RUN_GPU = inspect.Parameter(
    "dry_gpu",
    inspect.Parameter.KEYWORD_ONLY,
    default=None,
    annotation=Annotated[
        float | None,
        typer.Option(
            "--dry-run-gpu",
            metavar="GIB",
            help="With --dry-run: size the plan for a CUDA GPU of this many GiB, all free (141 for an H200), "
            "instead of this machine's device. \\[default: this machine's device]",
            show_default=False,
        ),
    ],
)


def _dry_run(options, json_output: bool, gpu_gib: float | None) -> dict[str, Any]:
    """`ouro train --dry-run` (rl/dry_run.py): the report on stdout (with --json, its document); a
    run that would not fit the device fails after the report, as the run would (exit 1)."""
    from ouro_cli.rl.dry_run import dry_run

    report = dry_run(options, gpu_gib)
    if not json_output:
        typer.echo(_dry_run_text(report))
    if report.memory_error is not None:  # the run would stop there: so does its dry run (exit 1)
        report.memory_error.result = report.document()
        raise report.memory_error
    return report.document()


def _dry_run_text(report) -> str:
    from ouro_cli.config import leaves, render
    from ouro_cli.rl.options import TrainOptions

    options, data, model = report.options, report.data, report.model
    lines = ["options, by TOML key (flags over --config over the defaults; auto resolved):"]
    values = options.to_dict()
    for leaf in by_panel(leaves(TrainOptions).values()):
        value = values[leaf.name]
        lines.append(f"  {leaf.name} = {leaf.shown_default if value is None else render(value)}")
    lines += [
        f"data: {data['rows']} training rows, {data['eval_rows']} held-out rows; reward {data['reward_function']}; "
        f"template {data['prompt_template']}; longest prompt {data['longest_prompt_tokens']} tokens + "
        f"--max-response-len {options.sampling.max_response_len} = {data['seq_tokens']} tokens per sequence",
        f"model: {model['path']}: {_count(model['parameters'])} parameters, {model['layers']} layers x "
        f"{model['loops']} loops, hidden {model['hidden_size']}, vocab {model['vocab_size']}, {model['dtype']} "
        "(its config.json and tokenizer read; no weights)",
        report.memory_line,
    ]
    return "\n".join(lines)


def _count(n: int) -> str:
    """A parameter count as people say it: 1.37B, 115.6k."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


def _train_command():
    from ouro_cli import config as tree
    from ouro_cli.rl.options import TrainOptions

    config = inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            Path | None,
            typer.Option(
                "--config",
                help="TOML file with any of these options (flags override it). \\[default: none]",
                rich_help_panel=P_DATA,
                show_default=False,
            ),
        ],
    )
    flags = [p for leaf in by_panel(tree.leaves(TrainOptions).values()) for p in parameters(leaf)]
    return with_options(
        _train, flags, head=[config], tail=[DRY_RUN, DRY_RUN_GPU, json_parameter(), _verbose_parameter()]
    )


# What `ouro resume` accepts besides --updates: the options a run may change (plan.FREE_KEYS and,
# with --override-scheduler, the LR), and some of its contract, which must equal the run's.
RESUME_OPTIONS = (
    "depths",
    "lr",
    "seed",
    "temperature",
    "group_size",
    "prompts_per_update",
    "advantage",
    "mini_batches",
    "epochs",
    "overlong",
    "loop_weighting",
    "max_num_seqs",
    "kv_transport",
    "compile",
    "compile_layers",
    "decode_attention",
    "decode_gemv",
    "replay_attention",
    "kv_cache_dtype",
    "share_prompts",
    "eval_data",
    "eval_interval",
    "save_interval",
    "export_hf",
    "plot",
    "save_on_interrupt",
    "async_save",
    "reward_timeout",
)


def _resume_command():
    from ouro_cli import config as tree
    from ouro_cli.rl.options import TrainOptions
    from ouro_cli.rl.plan import FREE_KEYS

    table = tree.leaves(TrainOptions)
    head = [
        inspect.Parameter(
            "run_dir",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            annotation=Annotated[Path, typer.Argument(help="Run directory written by ouro train.", show_default=False)],
        ),
        inspect.Parameter(
            "updates",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Annotated[
                int, typer.Option("--updates", help="Total updates to reach (more than the run has).")
            ],
        ),
        inspect.Parameter(
            "override_opt_param_scheduler",
            inspect.Parameter.KEYWORD_ONLY,
            default=False,
            annotation=Annotated[
                bool,
                typer.Option(
                    "--override-scheduler",
                    help="Allow a new LR schedule (lr, lr-schedule, warmup, min-lr). \\[default: off]",
                    rich_help_panel=P_OPT,
                    show_default=False,
                ),
            ],
        ),
    ]
    hidden_alias("--override-opt-param-scheduler", "--override-scheduler")
    flags = []
    for leaf in by_panel(table[name] for name in RESUME_OPTIONS):
        help = (
            "New LR (needs --override-scheduler)."
            if leaf.name == "lr"
            else None
            if leaf.name in FREE_KEYS
            else "Must equal the run's (checked)."
        )
        flags.extend(parameters(leaf, help=help, default="the run's"))
    return with_options(_resume, flags, head=head, tail=[json_parameter(), _verbose_parameter()])


train = _train_command()
resume = _resume_command()


def _quiet(body: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """`body` with third-party warnings sent to the run's logs/warnings.log (_run names it)."""
    from ouro_cli.warnings_log import quiet

    return quiet(body, lambda line: console.print(f"[dim]{line}[/]"))


def _note(message: str) -> None:
    console.print(f"[dim]{escape(message)}[/]")


def _run(
    options, run, *, resume: bool, override_scheduler: bool, json_output: bool, verbose: bool, command: str
) -> dict[str, Any]:
    from ouro_cli.warnings_log import attach_active

    main_rank = is_main_rank()
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
    from ouro_cli.rl.loop import train as train_loop

    from .progress import TrainDisplay

    with TrainDisplay(console, options.updates, verbose=verbose) as display:
        summary = train_loop(
            options,
            run,
            resume=resume,
            override_scheduler=override_scheduler,
            log=_note,
            progress=display,
            command=command,
        )
    report = report_console(json_output)
    _print_evaluations(summary, run, report)
    report.print(f"run directory: {summary['run_dir']}")
    return summary


def _print_evaluations(summary: dict[str, Any], run, report) -> None:
    """The held-out accuracy per K at the end, beside the run's start evaluation: this command's,
    or for a resumed run the one its first command wrote to evaluations.jsonl."""
    from rich.table import Table

    from ouro_cli.rl.metrics import read_jsonl

    started = summary["evaluations_before"] or [e for e in read_jsonl(run.evaluations) if e.get("when") == "start"]
    before = {e["k"]: e for e in started}
    after = summary["evaluations_after"]
    if not after:
        return
    table = Table(title="held-out accuracy")
    for col in ("K", "before", "after", "mean exit depth", "mean tokens"):
        table.add_column(col, justify="right")
    for e in after:
        b = before.get(e["k"])
        table.add_row(
            str(e["k"]),
            f"{b['accuracy']:.3f}" if b else "-",
            f"{e['accuracy']:.3f}",
            f"{e['mean_exit_depth']:.2f}",
            f"{e['mean_tokens']:.1f}",
        )
    report.print(table)
