"""`ouro convert hf-to-mcore | mcore-to-hf`: move Ouro weights between HF and Megatron, bit for bit.

The command validates its input completely (config, safetensors headers, every name
and shape) before it creates anything, then writes a staged artifact (weights,
manifest.json, COMPLETE last) that replaces OUT only when whole. The core lives in
`ouro_cli.checkpoint.convert`; this module parses, shows progress and prints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from .commands import Command
from .common import JSON_OPTION, OVERWRITE_OPTION, console, run_command

GROUP_EPILOG = """Examples:

  ouro convert hf-to-mcore ./Ouro-1.4B ./ckpt/ouro-1.4b-mcore            # HF → Megatron (release/)

  ouro convert mcore-to-hf ./ckpt/ouro-1.4b-mcore ./Ouro-1.4B-roundtrip  # and back, bit for bit

  ouro convert mcore-to-hf ./runs/grpo-1 ./export/ouro-grpo --json       # a run's latest checkpoint
"""

app = typer.Typer(
    name="convert",
    help="Convert Ouro checkpoints between Hugging Face and Megatron dist-checkpoint formats.",
    epilog=GROUP_EPILOG,
    no_args_is_help=True,
    rich_markup_mode="rich",
)

HF_TO_MCORE_EPILOG = """Examples:

  ouro convert hf-to-mcore ./Ouro-1.4B ./ckpt/ouro-1.4b-mcore

  ouro convert hf-to-mcore ./Ouro-1.4B ./ckpt/ouro-1.4b-mcore --overwrite --json
"""

MCORE_TO_HF_EPILOG = """Examples:

  ouro convert mcore-to-hf ./ckpt/ouro-1.4b-mcore ./Ouro-1.4B-roundtrip

  ouro convert mcore-to-hf ./runs/grpo-1/checkpoint ./export/ouro-grpo --max-shard-size 2GB --json
"""

OUTPUT_PANEL = "Output"


MaxShardSize = Annotated[
    str,
    typer.Option(
        "--max-shard-size",
        help="Largest safetensors shard (5GB = 5e9 bytes, 2GiB = 2**31); a model that fits is one model.safetensors.",
        rich_help_panel=OUTPUT_PANEL,
    ),
]


@contextmanager
def tensor_progress(total: int, description: str) -> Iterator[Callable[[str, Any], None]]:
    """A Rich progress bar on stderr over `total` tensors; yields the per-tensor callback.

    Only on a terminal: piped or captured stderr stays free of progress residue.
    """
    if not console.is_terminal:
        yield lambda name, tensor: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tensors"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda name, tensor: progress.advance(task)


def parse_max_shard_size(text: str) -> int:
    from ouro_cli.checkpoint import parse_size
    from ouro_cli.errors import UserError

    try:
        return parse_size(text)
    except ValueError as err:
        raise UserError(f"--max-shard-size: {err}") from None


def report(result: dict[str, Any], json_output: bool) -> None:
    if not json_output:
        console.print(
            f"wrote {result['output']} ({result['output_format']}): {result['tensors']} tensors, "
            f"{result['parameters']:,} parameters, {result['bytes'] / 1e9:.2f} GB "
            f"({', '.join(result['dtypes'])}) in {result['seconds']:.1f} s"
        )


@app.command("hf-to-mcore", epilog=HF_TO_MCORE_EPILOG, cls=Command)
def hf_to_mcore(
    hf_dir: Annotated[
        Path,
        typer.Argument(
            help="Hugging Face Ouro directory (config.json + model.safetensors or shards).", show_default=False
        ),
    ],
    out: Annotated[Path, typer.Argument(help="Megatron checkpoint directory to create.", show_default=False)],
    iteration: Annotated[
        int | None,
        typer.Option(
            "--iteration",
            min=0,
            show_default=False,
            help="Save as iter_NNNNNNN/ instead of release/. \\[default: release/]",
            rich_help_panel=OUTPUT_PANEL,
        ),
    ] = None,
    overwrite: bool = OVERWRITE_OPTION,
    json_output: bool = JSON_OPTION,
) -> None:
    """Convert a Hugging Face Ouro directory into a Megatron dist checkpoint."""

    def body() -> dict[str, Any]:
        from ouro_cli.checkpoint import convert, layout, open_checkpoint
        from ouro_cli.checkpoint.hf import HFCheckpoint
        from ouro_cli.errors import UserError

        source = open_checkpoint(hf_dir)
        if not isinstance(source, HFCheckpoint):
            raise UserError(f"{hf_dir} is a Megatron checkpoint, not a Hugging Face directory; use mcore-to-hf")
        it = layout.RELEASE if iteration is None else iteration
        options = {"hf_dir": str(hf_dir), "out": str(out), "iteration": it, "overwrite": overwrite}
        with tensor_progress(len(source.specs), "hf → mcore") as on_tensor:
            result = convert.to_megatron(
                source,
                out,
                iteration=it,
                overwrite=overwrite,
                command="convert hf-to-mcore",
                options=options,
                on_tensor=on_tensor,
            )
        report(result, json_output)
        return result

    run_command(body, json_output=json_output)


@app.command("mcore-to-hf", epilog=MCORE_TO_HF_EPILOG, cls=Command)
def mcore_to_hf(
    ckpt: Annotated[
        Path,
        typer.Argument(help="Megatron checkpoint directory (or a run directory with checkpoint/).", show_default=False),
    ],
    out: Annotated[Path, typer.Argument(help="Hugging Face directory to create.", show_default=False)],
    max_shard_size: MaxShardSize = "5GB",
    overwrite: bool = OVERWRITE_OPTION,
    json_output: bool = JSON_OPTION,
) -> None:
    """Convert a Megatron dist checkpoint into a Hugging Face Ouro directory."""

    def require_megatron(source) -> None:
        from ouro_cli.checkpoint.megatron import MegatronCheckpoint
        from ouro_cli.errors import UserError

        if not isinstance(source, MegatronCheckpoint):
            raise UserError(f"{ckpt} is a Hugging Face directory, not a Megatron checkpoint; use hf-to-mcore")

    write_hf_command(
        ckpt,
        out,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        json_output=json_output,
        command="convert mcore-to-hf",
        source_key="ckpt",
        label="mcore → hf",
        check=require_megatron,
    )


def write_hf_command(
    path: Path,
    out: Path,
    *,
    max_shard_size: str,
    overwrite: bool,
    json_output: bool,
    command: str,
    source_key: str,
    label: str,
    check=None,
) -> None:
    """The body shared by `convert mcore-to-hf` and `export`: any checkpoint to an HF directory."""

    def body() -> dict[str, Any]:
        from ouro_cli.checkpoint import convert, open_checkpoint
        from ouro_cli.checkpoint.sources import unfinished_run_note

        shard_bytes = parse_max_shard_size(max_shard_size)
        source = open_checkpoint(path)
        if check is not None:
            check(source)
        note = unfinished_run_note(path, source)
        if note:
            console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
        options = {source_key: str(path), "out": str(out), "max_shard_bytes": shard_bytes, "overwrite": overwrite}
        with tensor_progress(len(source.specs), label) as on_tensor:
            result = convert.to_hf(
                source,
                out,
                max_shard_bytes=shard_bytes,
                overwrite=overwrite,
                command=command,
                options=options,
                on_tensor=on_tensor,
            )
        report(result, json_output)
        return {**result, **({"note": note} if note else {})}

    run_command(body, json_output=json_output)
