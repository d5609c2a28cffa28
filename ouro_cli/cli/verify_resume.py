"""`ouro verify-resume`: prove that a fresh-process resume reproduces the continuous run.

    ouro verify-resume --updates N --resume-at M --work-dir W [ouro train options]
        W/reference: `ouro train` for N updates (fresh process)
        W/resumed:   `ouro train` for M updates, then `ouro resume` to N (fresh processes)
    ouro verify-resume --compare RUN_A RUN_B

Exit 0 when everything is bit-identical, 1 when something differs, 2 when a run failed
or the input was bad. `report.json` (in W, or beside RUN_A) holds the details. This
module parses and prints; the job (the work directory's rules, the disk check, the two
runs, the comparison) is `ouro_cli.checks.verify_resume`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from ouro_cli.errors import CheckFailed, UserError

from .common import JSON_OPTION, console, report_console, run_command
from .options import fold_negations
from .train import resolve_params

EPILOG = """Examples:

  ouro verify-resume --updates 4 --resume-at 2 --work-dir /tmp/vr --depths 2 3 4 --max-num-seqs 4 --exit-threshold 0.9

  ouro verify-resume --compare runs/local runs/pd
"""


def verify_resume(
    ctx: typer.Context,
    updates: Annotated[
        int | None,
        typer.Option(
            "--updates", help="Updates of the reference run (N). \\[default: none, required without --compare]"
        ),
    ] = None,
    resume_at: Annotated[
        int | None,
        typer.Option(
            "--resume-at",
            help="Stop the second run after M updates, then resume it to N. \\[default: none, required without "
            "--compare]",
        ),
    ] = None,
    work_dir: Annotated[
        Path | None,
        typer.Option(
            "--work-dir",
            help="Where the two runs and report.json go: empty, or an earlier work dir of verify-resume. \\[default: "
            "none, required without --compare]",
        ),
    ] = None,
    compare: Annotated[
        tuple[Path, Path] | None,
        typer.Option("--compare", help="Compare two existing run directories instead. \\[default: none]"),
    ] = None,
    json_output: bool = JSON_OPTION,
) -> None:
    """Run a job continuously and with a fresh-process resume, then compare them bit for bit."""
    train_args = list(ctx.args)

    def body() -> dict[str, Any]:
        from ouro_cli.checks import verify_resume as vr

        if compare:
            report = vr.compare_held(*(Path(p) for p in compare))
        else:
            if updates is None or resume_at is None or work_dir is None:
                raise UserError("give --updates N --resume-at M --work-dir W (or --compare RUN_A RUN_B)")
            if not 0 < resume_at < updates:
                raise UserError(f"--resume-at must lie in 1..{updates - 1}")
            forbidden = {"--run-dir", "--updates", "--overwrite"} & set(train_args)
            if forbidden:
                raise UserError(f"{sorted(forbidden)[0]} is set by verify-resume itself")
            options = _train_options(ctx, train_args)
            inputs = [
                Path(options.model),
                Path(options.data),
                *([Path(options.eval_data)] if options.eval_data else []),
            ]
            report = vr.verify(
                train_args,
                model=options.model,
                inputs=inputs,
                updates=updates,
                resume_at=resume_at,
                work=Path(work_dir),
                log=lambda m: console.print(f"[dim]{escape(m)}[/]"),
            )
        out = report_console(json_output)  # the command's product: stdout
        _print(report, out)
        result = {**report.to_dict(), "report": report.path}
        if not report.identical:
            err = CheckFailed(f"runs differ; first divergence: {report.first_divergence}")
            err.result = result
            raise err
        out.print(f"[bold green]bit-identical[/] ({report.path})")
        return result

    from ouro_cli.warnings_log import quiet

    run_command(quiet(body, lambda line: console.print(f"[dim]{line}[/]")), json_output=json_output)


def _train_options(ctx: typer.Context, train_args: list[str]):
    """The forwarded `ouro train` arguments as TrainOptions, parsed as train parses them (so that
    bad arguments fail here, before any run starts): by the `train` command of the application
    this command runs in."""
    root = ctx.find_root()
    command = root.command.get_command(root, "train")
    try:
        params = command.make_context("train", list(train_args)).params
    except Exception as err:  # click's usage errors (typer vendors click under its own name)
        if not hasattr(err, "format_message"):
            raise
        raise UserError(f"the ouro train options: {err.format_message()}") from None
    return resolve_params(fold_negations(params))


def _print(report, out) -> None:
    from rich.table import Table

    table = Table(title=f"{report.run_a}  vs  {report.run_b}")
    for col in ("category", "compared", "differing", "result"):
        table.add_column(col)
    for c in report.categories:
        table.add_row(c.name, str(c.compared), str(c.differing), "[green]identical[/]" if c.ok else "[red]DIFFERS[/]")
    out.print(table)
    if report.first_divergence:
        out.print(f"first divergence: {report.first_divergence}")
