"""`ouro probe-ucx`: check which UCX transport settings deliver bytes, and recommend one.

Each setting runs in two fresh processes (NIXL agents, UCX backend): one WRITEs a
known pattern with a notification into a buffer the other registered (VRAM on CUDA,
DRAM otherwise), and the receiver checks every byte — completion alone never passes.
Writes `probe.json` through the output guard (ouro_cli/outputs.py: an existing one only with
`--overwrite`). Exit 0 when a setting delivered, 1 when none did, 2 when NIXL is not installed
(with the install hint) or the input is bad.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import JSON_OPTION, console, report_console, run_command

OVERWRITE = typer.Option("--overwrite", help="Replace an existing probe.json. \\[default: off]", show_default=False)

EPILOG = """Examples:

  ouro probe-ucx

  ouro probe-ucx --devices 0 1 --tls rc,cuda_copy cuda_ipc,cuda_copy --json

  UCX_TLS=tcp,cuda_copy ouro train ... --prefill-devices 0 --decode-devices 1   (apply the recommendation)
"""


def probe_ucx(
    ctx: typer.Context,
    devices: Annotated[
        tuple[int, int], typer.Option("--devices", help="Initiator and target device (CUDA indices).")
    ] = (0, 1),
    tls: Annotated[
        list[str] | None,
        typer.Option("--tls", help="Extra UCX_TLS settings to try, e.g. --tls rc,cuda_copy tcp. \\[default: none]"),
    ] = None,
    size_mb: Annotated[int, typer.Option("--size-mb", help="Bytes per WRITE, in MiB.")] = 64,
    repeats: Annotated[int, typer.Option("--repeats", help="WRITEs per setting (median time is reported).")] = 3,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per setting before it counts as hung.")] = 30.0,
    out: Annotated[Path, typer.Option("--out", help="Directory for probe.json.")] = Path("."),
    overwrite: Annotated[bool, OVERWRITE] = False,
    json_output: bool = JSON_OPTION,
) -> None:
    """Probe UCX transport settings between two processes; recommend the fastest that delivered."""
    extra = list(ctx.args)  # `--tls a b c`: values after the first stay in ctx.args

    def body() -> dict[str, Any]:
        from ouro_cli.outputs import claimed_output

        with claimed_output(out / "probe.json", overwrite=overwrite, command="ouro probe-ucx", file=True) as output:
            return _probe(output)

    def _probe(output) -> dict[str, Any]:
        from ouro_cli.engine.pd.transport import NIXL_INSTALL_HINT, nixl_available
        from ouro_cli.errors import CheckFailed, UserError

        unknown = [a for a in extra if a.startswith("-")]
        if unknown:
            raise UserError(f"unknown option {unknown[0]}")
        if not nixl_available():
            raise UserError(f"NIXL is not installed, so UCX cannot be probed; install it with: {NIXL_INSTALL_HINT}")
        if size_mb < 1 or repeats < 1 or timeout <= 0:
            raise UserError("--size-mb and --repeats must be >= 1 and --timeout > 0")
        from ouro_cli.checks.probe_ucx import DEFAULT_SETTINGS, run_probe

        settings: list[str | None] = list(DEFAULT_SETTINGS)
        for setting in [*(tls or []), *extra]:
            if setting not in settings:
                settings.append(setting)
        console.print(f"probing {len(settings)} UCX settings, {size_mb} MiB × {repeats} WRITEs each")
        document = run_probe(settings, devices=devices, size=size_mb << 20, repeats=repeats, timeout=timeout)
        with output.staged() as staging:
            staging.write_text(json.dumps(document, indent=2) + "\n")
        path = output.path
        document["probe_json"] = str(path)
        _print(document, report_console(json_output))  # the command's product: stdout
        if document["recommended"] is None:
            err = CheckFailed(f"no UCX setting delivered the bytes (details in {path})")
            err.result = document
            raise err
        return document

    run_command(body, json_output=json_output)


def _print(document: dict[str, Any], out) -> None:
    from rich.table import Table

    table = Table(
        title=f"UCX over NIXL, {document['memory']} → {document['memory']}, "
        f"{document['bytes'] >> 20} MiB × {document['repeats']}"
    )
    for col in ("UCX_TLS", "result", "completed", "notified", "bad bytes", "GB/s", "note"):
        table.add_column(col)
    style = {"delivered": "green", "completed_not_delivered": "bold red", "failed": "red", "timeout": "red"}
    for r in document["results"]:
        table.add_row(
            r["label"],
            f"[{style[r['status']]}]{r['status']}[/]",
            str(r["completed"]),
            f"{r['notified']}/{document['repeats']}",
            str(r["mismatched_bytes"]),
            f"{r['gbps']:.2f}" if r["gbps"] else "-",
            (r["error"] or "")[:80],
        )
    out.print(table)
    rec = document["recommended"]
    if rec:
        out.print(f"recommended: [bold]{rec['label']}[/] ({rec['gbps']:.2f} GB/s) — apply with: {rec['apply']}")
