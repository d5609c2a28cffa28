"""The `ouro` Typer application. Heavy imports (torch, megatron) happen inside commands,
so `ouro --help` stays fast."""

from __future__ import annotations

import typer

from . import convert, eval, export, probe_ucx, train, verify_resume

app = typer.Typer(
    name="ouro",
    help="On-policy RL (GRPO) for Ouro looped language models: convert, train, resume, export, eval.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
    rich_markup_mode="rich",
)
app.add_typer(convert.app, name="convert")
app.command(name="export", epilog=export.EPILOG)(export.export)
app.command(name="train", epilog=train.TRAIN_EPILOG)(train.train)
app.command(name="resume", epilog=train.RESUME_EPILOG)(train.resume)
app.command(name="eval", epilog=eval.EPILOG)(eval.eval_command)
app.command(name="verify-resume", epilog=verify_resume.EPILOG,
            context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(verify_resume.verify_resume)
app.command(name="probe-ucx", epilog=probe_ucx.EPILOG, context_settings={"allow_extra_args": True})(probe_ucx.probe_ucx)


def main() -> None:
    import sys
    import warnings

    # megatron-core announces its pure-PyTorch fallbacks on import; they are expected here
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

    from .common import expand_multi_value_options

    app(args=expand_multi_value_options(sys.argv[1:]), prog_name="ouro")


if __name__ == "__main__":
    main()
