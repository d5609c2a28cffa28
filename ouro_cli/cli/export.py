"""`ouro export CKPT_OR_RUN OUT`: the Hugging Face directory a training run or checkpoint stands for.

The result loads with the original remote code: config.json (unknown keys kept), the
tokenizer files and the `*.py` remote code come from the checkpoint's `hf_assets/`
(copied there by `ouro convert hf-to-mcore` and by the trainer). A run directory is
read through `RUN/checkpoint/`, at its latest complete iteration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .common import JSON_OPTION, OVERWRITE_OPTION, run_command
from .convert import MaxShardSize, parse_max_shard_size, report, tensor_progress

EPILOG = """Examples:

  ouro export ./runs/grpo-1 ./export/ouro-1.4b-grpo

  ouro export ./runs/grpo-1/checkpoint ./export/ouro-1.4b-grpo --overwrite --json

  ouro export ./ckpt/ouro-1.4b-mcore ./export/ouro-1.4b --max-shard-size 2GB
"""


def export(
    ckpt_or_run: Annotated[Path, typer.Argument(
        help="Run directory, Megatron checkpoint or HF directory to export.", show_default=False)],
    out: Annotated[Path, typer.Argument(help="Hugging Face directory to create.", show_default=False)],
    max_shard_size: MaxShardSize = "5GB",
    overwrite: bool = OVERWRITE_OPTION,
    json_output: bool = JSON_OPTION,
) -> None:
    """Export a run or checkpoint as a Hugging Face Ouro directory (loads with the original remote code)."""

    def body() -> dict[str, Any]:
        from ouro_cli.checkpoint import convert, open_checkpoint

        shard_bytes = parse_max_shard_size(max_shard_size)
        source = open_checkpoint(ckpt_or_run)
        options = {"ckpt_or_run": str(ckpt_or_run), "out": str(out), "max_shard_bytes": shard_bytes,
                   "overwrite": overwrite}
        with tensor_progress(len(source.specs), "export") as on_tensor:
            result = convert.to_hf(source, out, max_shard_bytes=shard_bytes, overwrite=overwrite,
                                   command="export", options=options, on_tensor=on_tensor)
        report(result, json_output)
        return result

    run_command(body, json_output=json_output)
