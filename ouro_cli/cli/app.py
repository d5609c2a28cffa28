"""The `ouro` Typer application. Heavy imports (torch, megatron) happen inside commands,
so `ouro --help` stays fast. SIGINT and SIGTERM are handled from the first line on
(signals.py): run as `python -m ouro_cli.cli.app`, before this module's own imports."""

from __future__ import annotations

from ouro_cli.cli import signals

if __name__ == "__main__":
    signals.install()

import typer  # noqa: E402

from ouro_cli import env  # noqa: E402

from . import compare, convert, data, eval, export, probe_ucx, status, train, verify_resume  # noqa: E402
from .commands import Command, Group  # noqa: E402
from .common import DEBUG_ENV  # noqa: E402

EPILOG = """Examples:

  ouro train --depths 2 3 4                                   # GRPO on the bundled tiny model

  ouro resume runs/ouro-20250101-120000 --updates 120         # continue a run (also after a crash)

  ouro eval runs/grpo-1 --data eval.jsonl --depths 2 3 4      # held-out accuracy per K

  ouro status runs/grpo-1                                     # where a run stands (also while it runs)

  ouro data check train.parquet --label-key answer            # rows, prompt lengths, bad rows

  ouro export runs/grpo-1 export/ouro-grpo                    # HF directory of the trained model

  ouro compare runs/one-rank runs/two-ranks                   # two placements of one job, within tolerance

  ouro convert hf-to-mcore ./Ouro-1.4B ckpt/ouro-1.4b-mcore   # HF → Megatron checkpoint

  ouro --debug train --config recipe.toml                     # a failure shows its traceback
"""

app = typer.Typer(
    name="ouro",
    help="On-policy RL (GRPO) for Ouro looped language models: train, resume, eval, data, export, convert, compare.",
    cls=Group,
    epilog=EPILOG,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
    rich_markup_mode="rich",
)


@app.callback()
def _global_options(
    debug: bool = typer.Option(
        False,
        "--debug",
        help=f"Show a failure's traceback (as {DEBUG_ENV}=1 does); accepted anywhere on the line. \\[default: off]",
    ),
) -> None:
    if debug:
        env.put(DEBUG_ENV, "1")  # also seen by the processes a command starts (verify-resume)


app.command(name="train", epilog=train.TRAIN_EPILOG, cls=Command)(train.train)
app.command(name="resume", epilog=train.RESUME_EPILOG, cls=Command)(train.resume)
app.command(name="eval", epilog=eval.EPILOG, cls=Command)(eval.eval_command)
app.add_typer(data.app, name="data")
app.command(name="status", epilog=status.STATUS_EPILOG, cls=Command)(status.status)
app.command(name="plot", epilog=status.PLOT_EPILOG, cls=Command)(status.plot)
app.command(name="export", epilog=export.EPILOG, cls=Command)(export.export)
app.add_typer(convert.app, name="convert")
app.command(name="compare", epilog=compare.EPILOG, cls=Command)(compare.compare)
app.command(
    name="verify-resume",
    epilog=verify_resume.EPILOG,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    cls=Command,
)(verify_resume.verify_resume)
app.command(name="probe-ucx", epilog=probe_ucx.EPILOG, context_settings={"allow_extra_args": True}, cls=Command)(
    probe_ucx.probe_ucx
)


def main() -> None:
    import sys
    import warnings

    signals.install()
    # megatron-core announces its pure-PyTorch fallbacks on import, and its dist-checkpoint
    # loader calls a torch API that torch marks deprecated; neither is the user's business
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", message=".*load_state_dict.* is deprecated", category=FutureWarning)

    from ouro_cli.children import die_with_this_process

    from .common import expand_multi_value_options, rewrite_aliases, run_app

    die_with_this_process()  # megatron's forked checkpoint writers must not outlive a killed command

    args = rewrite_aliases(sys.argv[1:])
    head = args[: args.index("--")] if "--" in args else args
    if "--debug" in head[1:]:  # a global flag, accepted after the command too
        args.remove("--debug")
        args.insert(0, "--debug")
    sys.exit(run_app(app, expand_multi_value_options(args), json_output="--json" in head))


if __name__ == "__main__":
    main()
