"""`ouro compare RUN_A RUN_B`: two placements of one job (1 vs N ranks, local vs PD, CPU vs
GPU) judged within stated tolerances (`ouro_cli.checks.compare`); `ouro verify-resume
--compare` is the bit-for-bit check. Prints the per-update and per-tensor tables; exit 0
within tolerance, 1 beyond it, 2 on bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .common import JSON_OPTION, console, report_console, run_command

EPILOG = """Examples:

  ouro compare runs/one-rank runs/two-ranks --weights-atol 1e-4     # fp32 runs (Adam at lr 1e-4)

  ouro compare runs/local runs/pd --tolerance bf16 --json > compare.json
"""


def _preset_default(name: str) -> str:
    """How the help states a tolerance's default: each preset's value (checks/compare.py PRESETS)."""
    from ouro_cli.checks.compare import PRESETS

    return "the preset's: " + ", ".join(f"{preset} {getattr(t, name):g}" for preset, t in PRESETS.items())


def _tolerance(name: str, help: str) -> Any:
    return typer.Option(
        name, help=f"{help} \\[default: {_preset_default(name[2:].replace('-', '_'))}]", show_default=False
    )


def compare(
    run_a: Annotated[Path, typer.Argument(help="Reference run directory (e.g. one rank).", show_default=False)],
    run_b: Annotated[Path, typer.Argument(help="Run directory to compare (e.g. two ranks).", show_default=False)],
    tolerance: Annotated[
        str, typer.Option("--tolerance", help="Preset for the runs' dtype: fp32 or bf16; the flags below override it.")
    ] = "fp32",
    atol: Annotated[
        float | None,
        _tolerance(
            "--atol",
            "Absolute tolerance of weights and gradient norm, floor of the self-calibrated logprob tolerances.",
        ),
    ] = None,
    rtol: Annotated[float | None, _tolerance("--rtol", "Relative tolerance, |Δ| <= atol + rtol·|w|.")] = None,
    weights_atol: Annotated[
        float | None,
        typer.Option(
            "--weights-atol",
            help="The weights' own absolute tolerance (fp32 Adam runs: the learning rate). \\[default: --atol]",
            show_default=False,
        ),
    ] = None,
    min_identical: Annotated[
        float | None, _tolerance("--min-identical", "Fraction of rollout samples whose tokens must be identical.")
    ] = None,
    max_update_diff: Annotated[
        float | None, _tolerance("--max-update-diff", "Largest ‖w_B − w_A‖ / ‖w_A − w_0‖.")
    ] = None,
    json_output: bool = JSON_OPTION,
) -> None:
    """Compare two runs of one job within stated tolerances (placement, not bit identity)."""

    def body() -> dict[str, Any]:
        from ouro_cli.checks.compare import PRESETS, format_report, report
        from ouro_cli.errors import CheckFailed, UserError

        if tolerance not in PRESETS:
            raise UserError(f"--tolerance must be {' or '.join(PRESETS)}, got {tolerance!r}")
        for run in (run_a, run_b):
            if not run.is_dir():
                raise UserError(f"{run} is not a directory")
        chosen = PRESETS[tolerance].with_(
            atol=atol,
            rtol=rtol,
            weights_atol=weights_atol,
            min_identical=min_identical,
            max_update_diff=max_update_diff,
        )
        doc = report(run_a, run_b, chosen)
        report_console(json_output).print(format_report(doc), markup=False, highlight=False, soft_wrap=True)
        if not doc["ok"]:
            failed = ", ".join(k for k, ok in doc["checks"].items() if not ok)
            err = CheckFailed(f"{run_b} is beyond tolerance of {run_a}: {failed}")
            err.result = doc
            raise err
        return doc

    from ouro_cli.warnings_log import quiet

    run_command(quiet(body, lambda line: console.print(f"[dim]{line}[/]")), json_output=json_output)
