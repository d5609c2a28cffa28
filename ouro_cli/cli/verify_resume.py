"""`ouro verify-resume`: prove that a fresh-process resume reproduces the continuous run.

    ouro verify-resume --updates N --resume-at M --work-dir W [ouro train options]
        W/reference: `ouro train` for N updates (fresh process)
        W/resumed:   `ouro train` for M updates, then `ouro resume` to N (fresh processes)
    ouro verify-resume --compare RUN_A RUN_B

Exit 0 when everything is bit-identical, 1 when something differs, 2 when a run failed
or the input was bad. `report.json` (in W, or beside RUN_A) holds the details.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import JSON_OPTION, console, run_command

EPILOG = """Examples:

  ouro verify-resume --updates 4 --resume-at 2 --work-dir /tmp/vr --depths 2 3 4 --max-num-seqs 4 --exit-threshold 0.9

  ouro verify-resume --compare runs/local runs/pd
"""


def verify_resume(
    ctx: typer.Context,
    updates: Annotated[int | None, typer.Option("--updates", help="Updates of the reference run (N).")] = None,
    resume_at: Annotated[int | None, typer.Option("--resume-at", help="Stop the second run after M updates, then resume it to N.")] = None,
    work_dir: Annotated[Path | None, typer.Option("--work-dir", help="Where the two runs and report.json go.")] = None,
    compare: Annotated[tuple[Path, Path] | None, typer.Option("--compare", help="Compare two existing run directories instead.")] = None,
    json_output: bool = JSON_OPTION,
) -> None:
    """Run a job continuously and with a fresh-process resume, then compare them bit for bit."""
    train_args = list(ctx.args)

    def body() -> dict[str, Any]:
        from ouro_cli.errors import CheckFailed, UserError
        from ouro_cli.tools.verify_resume import compare_runs

        if compare:
            run_a, run_b = compare
            report_path = Path(run_a).parent / "report.json"
        else:
            if updates is None or resume_at is None or work_dir is None:
                raise UserError("give --updates N --resume-at M --work-dir W (or --compare RUN_A RUN_B)")
            if not 0 < resume_at < updates:
                raise UserError(f"--resume-at must lie in 1..{updates - 1}")
            forbidden = {"--run-dir", "--updates", "--overwrite"} & set(train_args)
            if forbidden:
                raise UserError(f"{sorted(forbidden)[0]} is set by verify-resume itself")
            run_a, run_b = Path(work_dir) / "reference", Path(work_dir) / "resumed"
            report_path = Path(work_dir) / "report.json"
            _run_pair(train_args, updates, resume_at, run_a, run_b)
        report = compare_runs(Path(run_a), Path(run_b))
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
        _print(report)
        result = {**report.to_dict(), "report": str(report_path)}
        if not report.identical:
            err = CheckFailed(f"runs differ; first divergence: {report.first_divergence}")
            err.result = result
            raise err
        console.print(f"[bold green]bit-identical[/] ({report_path})")
        return result

    run_command(body, json_output=json_output)


def _ouro(args: list[str], what: str) -> None:
    from ouro_cli.errors import UserError

    console.print(f"[dim]$ ouro {' '.join(args)}[/]")
    proc = subprocess.run([sys.executable, "-m", "ouro_cli.cli.app", *args], env=os.environ.copy(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"the {what} failed (exit {proc.returncode}): {tail[0]}")


def _run_pair(train_args: list[str], updates: int, resume_at: int, run_a: Path, run_b: Path) -> None:
    common = [*train_args, "--state-digest", "--overwrite"]
    _ouro(["train", *common, "--updates", str(updates), "--run-dir", str(run_a)], "reference run")
    _ouro(["train", *common, "--updates", str(resume_at), "--run-dir", str(run_b)], f"first {resume_at} updates")
    _ouro(["resume", str(run_b), "--updates", str(updates)], "resume")


def _print(report) -> None:
    from rich.table import Table

    table = Table(title=f"{report.run_a}  vs  {report.run_b}")
    for col in ("category", "compared", "differing", "result"):
        table.add_column(col)
    for c in report.categories:
        table.add_row(c.name, str(c.compared), str(c.differing), "[green]identical[/]" if c.ok else "[red]DIFFERS[/]")
    console.print(table)
    if report.first_divergence:
        console.print(f"first divergence: {report.first_divergence}")
