"""`ouro verify-resume`: prove that a fresh-process resume reproduces the continuous run.

    ouro verify-resume --updates N --resume-at M --work-dir W [ouro train options]
        W/reference: `ouro train` for N updates (fresh process)
        W/resumed:   `ouro train` for M updates, then `ouro resume` to N (fresh processes)
    ouro verify-resume --compare RUN_A RUN_B

Exit 0 when everything is bit-identical, 1 when something differs, 2 when a run failed
or the input was bad. `report.json` (in W, or beside RUN_A) holds the details.

W must be empty or one of verify-resume's own earlier work directories (its marker
`verify-resume.json` or a `report.json`, and nothing but the two runs besides), and must
lie outside the train options' model and data, so that the runs' `--overwrite` can only
replace earlier runs of verify-resume. W is locked (ouro_cli.rl.lock) while it works, and
`--compare` holds both runs' locks while it reads them.

Disk: before anything runs, W's filesystem must hold two checkpoints of the model (the
size follows from its parameter count: bf16 weights, fp32 main weights and both Adam
moments at most), which is what the runs hold at once: the reference run's checkpoint is
replaced by its digest once it is complete (tools/verify_resume.py `drop_checkpoint`), and
both runs keep one iteration (`--keep-last 1` unless given), the resumed run holding its
M-th while it writes its N-th. At Ouro-1.4B that is 40 GB.
"""

from __future__ import annotations

import contextlib
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


REFERENCE, RESUMED, REPORT, MARKER, LOGS = "reference", "resumed", "report.json", "verify-resume.json", "logs"


def verify_resume(
    ctx: typer.Context,
    updates: Annotated[int | None, typer.Option("--updates", help="Updates of the reference run (N). \\[default: none, required without --compare]")] = None,
    resume_at: Annotated[int | None, typer.Option("--resume-at", help="Stop the second run after M updates, then resume it to N. \\[default: none, required without --compare]")] = None,
    work_dir: Annotated[Path | None, typer.Option("--work-dir", help="Where the two runs and report.json go: empty, or an earlier work dir of verify-resume. \\[default: none, required without --compare]")] = None,
    compare: Annotated[tuple[Path, Path] | None, typer.Option("--compare", help="Compare two existing run directories instead. \\[default: none]")] = None,
    json_output: bool = JSON_OPTION,
) -> None:
    """Run a job continuously and with a fresh-process resume, then compare them bit for bit."""
    train_args = list(ctx.args)

    def body() -> dict[str, Any]:
        from ouro_cli.errors import UserError
        from ouro_cli.rl.lock import RunLock

        if compare:
            run_a, run_b = (Path(p) for p in compare)
            with contextlib.ExitStack() as held:
                for run in dict.fromkeys((run_a.resolve(), run_b.resolve())):
                    held.enter_context(RunLock(run, "ouro verify-resume --compare", create=False))
                return _report(run_a, run_b, run_a.parent / REPORT)
        if updates is None or resume_at is None or work_dir is None:
            raise UserError("give --updates N --resume-at M --work-dir W (or --compare RUN_A RUN_B)")
        if not 0 < resume_at < updates:
            raise UserError(f"--resume-at must lie in 1..{updates - 1}")
        forbidden = {"--run-dir", "--updates", "--overwrite"} & set(train_args)
        if forbidden:
            raise UserError(f"{sorted(forbidden)[0]} is set by verify-resume itself")
        work = Path(work_dir)
        options = _train_options(train_args)
        _check_work_dir(work, [Path(options.model), Path(options.data),
                               *([Path(options.eval_data)] if options.eval_data else [])])
        _check_disk(work, options.model)
        with RunLock(work, "ouro verify-resume", log=lambda m: console.print(f"[dim]{m}[/]")):
            from ouro_cli.artifacts import write_json_atomic
            from ouro_cli.warnings_log import attach_active

            write_json_atomic(work / MARKER, {"updates": updates, "resume_at": resume_at, "train_args": train_args})
            attach_active(work / LOGS / "warnings.log")
            _run_pair(train_args, updates, resume_at, work / REFERENCE, work / RESUMED)
            return _report(work / REFERENCE, work / RESUMED, work / REPORT)

    from ouro_cli.warnings_log import quiet

    run_command(quiet(body, lambda line: console.print(f"[dim]{line}[/]")), json_output=json_output)


def _train_options(train_args: list[str]):
    """The forwarded `ouro train` arguments as TrainOptions, parsed as train parses them (so that
    bad arguments fail here, before any run starts)."""
    import typer.main

    from ouro_cli.errors import UserError

    from .app import app
    from .train import resolve_params

    command = typer.main.get_command(app).commands["train"]
    try:
        params = command.make_context("train", list(train_args)).params
    except Exception as err:  # click's usage errors (typer vendors click under its own name)
        if not hasattr(err, "format_message"):
            raise
        raise UserError(f"the ouro train options: {err.format_message()}") from None
    return resolve_params(params)


CHECKPOINT_BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weights, fp32 main weights, Adam's two moments
DISK_MARGIN = 1.05


def _check_disk(work: Path, model: str) -> None:
    """W's filesystem must hold the two checkpoints the runs hold at once (module docstring);
    earlier runs in W, which the new ones replace, count as free."""
    import shutil

    from ouro_cli.checkpoint import open_checkpoint
    from ouro_cli.errors import ResourceError
    from ouro_cli.rl.sizing import GIB, parameter_counts

    total, _ = parameter_counts(open_checkpoint(Path(model)).config)
    need = int(2 * total * CHECKPOINT_BYTES_PER_PARAM * DISK_MARGIN)
    where = work if work.exists() else next(p for p in work.absolute().parents if p.exists())
    earlier = sum(f.stat().st_size for run in (REFERENCE, RESUMED) for f in (work / run).rglob("*") if f.is_file())
    free = shutil.disk_usage(where).free + earlier
    if free < need:
        raise ResourceError(f"verify-resume needs about {need / GIB:.1f} GiB of disk for its two runs' checkpoints "
                            f"(two of {total * CHECKPOINT_BYTES_PER_PARAM / GIB:.1f} GiB), {where} has "
                            f"{free / GIB:.1f} GiB free; choose a --work-dir on a larger disk")


def _check_work_dir(work: Path, inputs: list[Path]) -> None:
    """The output guard (artifacts.py) for W, plus: empty, or an earlier work dir of verify-resume."""
    from ouro_cli.artifacts import check_outside_inputs, check_writable
    from ouro_cli.errors import UserError
    from ouro_cli.rl.lock import LOCK_FILE

    check_outside_inputs(work, inputs, what="work directory")
    check_writable(work, what="work directory")
    if not work.is_dir():
        return
    names = {p.name for p in work.iterdir()} - {LOCK_FILE}
    ours = {REFERENCE, RESUMED, REPORT, MARKER, LOGS}
    if names and (not names & {REPORT, MARKER} or names - ours):
        other = sorted(names - ours) or sorted(names)
        raise UserError(f"work directory {work} is not empty ({other[0]}) and is not an earlier verify-resume work "
                        f"directory (those hold only {', '.join(sorted(ours))}); choose an empty one")


def _report(run_a: Path, run_b: Path, report_path: Path) -> dict[str, Any]:
    from ouro_cli.errors import CheckFailed
    from ouro_cli.tools.verify_resume import compare_runs

    report = compare_runs(run_a, run_b)
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


def _ouro(args: list[str], what: str) -> None:
    from ouro_cli.errors import UserError

    console.print(f"[dim]$ ouro {' '.join(args)}[/]")
    proc = subprocess.run([sys.executable, "-m", "ouro_cli.cli.app", *args], env=os.environ.copy(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"the {what} failed (exit {proc.returncode}): {tail[0]}")


def _run_pair(train_args: list[str], updates: int, resume_at: int, run_a: Path, run_b: Path) -> None:
    from ouro_cli.rl.run_dir import RunDir
    from ouro_cli.tools.verify_resume import drop_checkpoint

    keep = [] if "--keep-last" in train_args else ["--keep-last", "1"]  # one iteration each: the disk check
    common = [*train_args, *keep, "--state-digest", "--overwrite"]
    _ouro(["train", *common, "--updates", str(updates), "--run-dir", str(run_a)], "reference run")
    drop_checkpoint(RunDir(run_a))  # its digest is all the comparison needs
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
