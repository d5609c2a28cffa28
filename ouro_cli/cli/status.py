"""`ouro status RUN` and `ouro plot RUN`: read a run's files, change nothing in it but metrics.png.

`plot --out FILE` writes elsewhere through the output guard (ouro_cli/outputs.py): never into
a run's own files, an existing FILE only with `--overwrite`, and the PNG appears whole."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .common import JSON_OPTION, console, report_console, rich_escape, run_command

STATUS_EPILOG = """Examples:

  ouro status runs/grpo-1

  ouro status runs/grpo-1 --json
"""

PLOT_EPILOG = """Examples:

  ouro plot runs/grpo-1                     # redraws runs/grpo-1/metrics.png

  ouro plot runs/grpo-1 --out /tmp/run.png
"""

RUN_ARGUMENT = typer.Argument(help="Run directory written by ouro train.", show_default=False)


def status(run_dir: Annotated[Path, RUN_ARGUMENT], json_output: bool = JSON_OPTION) -> None:
    """Where a run stands: updates done, last reward and accuracy per K, checkpoint, whether it runs."""

    def body() -> dict[str, Any]:
        from rich.table import Table

        from ouro_cli.rl.status import run_status

        s = run_status(run_dir)
        out = report_console(json_output)  # the report is the command's product: stdout
        state = (
            "[green]complete[/]"
            if s["complete"]
            else f"[yellow]running[/] ({s['holder']})"
            if s["running"]
            else "stopped (not complete; `ouro resume` continues it)"
        )
        ckpt = s["checkpoint"]
        out.print(f"[bold]{rich_escape(s['run_dir'])}[/]: {state}")
        out.print(
            f"updates {s['updates_done']} of {s['updates_total']}; latest checkpoint: "
            + (
                f"{ckpt.get('path', ckpt.get('problem'))} (continues at update {ckpt.get('next_update')})"
                if ckpt
                else "none yet"
            )
        )
        out.print(f"plan {s['plan_sha256'][:12]}")
        for note in s["notes"]:
            _note(note)  # about reading the files (a cut last line): a log line
        table = Table()
        for col in ("K", "last training reward", "held-out accuracy"):
            table.add_column(col, justify="right")
        for k in sorted({*s["last_reward_per_k"], *s["accuracy_per_k"]}, key=int):
            r, a = s["last_reward_per_k"].get(k), s["accuracy_per_k"].get(k)
            table.add_row(
                k,
                f"{r['reward_mean']:.3f} (update {r['update']})" if r else "-",
                f"{a['accuracy']:.3f} (update {a['update']}, {a['when']})" if a else "-",
            )
        out.print(table)
        return s

    run_command(body, json_output=json_output)


def plot(
    run_dir: Annotated[Path, RUN_ARGUMENT],
    out: Annotated[
        Path | None, typer.Option("--out", help="Where to write the PNG. \\[default: RUN/metrics.png]")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing --out file. \\[default: off]", show_default=False)
    ] = False,
    json_output: bool = JSON_OPTION,
) -> None:
    """Redraw a run's metrics.png from its metrics.jsonl and evaluations.jsonl."""

    def body() -> dict[str, Any]:
        import contextlib

        from ouro_cli.errors import UserError
        from ouro_cli.outputs import Output, claimed_output
        from ouro_cli.rl.plots import plot_run
        from ouro_cli.rl.run_dir import RunDir

        run = RunDir(run_dir)
        if not run.is_run():
            raise UserError(f"{run.root} is not an ouro run directory (no {run.plan.name})")
        if out is None or out.resolve() == run.plot.resolve():  # the run's own plot, redrawn
            claimed = contextlib.nullcontext(Output(run.plot, overwrite=True, file=True))
        else:
            claimed = claimed_output(
                out, overwrite=overwrite, command="ouro plot", file=True, inputs=[run.metrics, run.evaluations]
            )
        with claimed as output, output.staged() as staging:
            if plot_run(run.metrics, run.evaluations, staging, log=_note) is None:
                raise UserError(f"nothing to plot: {run.metrics} has no updates yet, or matplotlib is not installed")
        console.print(f"wrote {output.path}")
        return {"plot": str(output.path)}

    run_command(body, json_output=json_output)


def _note(message: str) -> None:
    console.print(f"[dim]{rich_escape(message)}[/]", soft_wrap=True)
