"""The `ouro` Typer application. Heavy imports (torch, megatron) happen inside commands,
so `ouro --help` stays fast."""

from __future__ import annotations

import typer

from . import convert, export

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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
