"""`ouro export CKPT_OR_RUN OUT`: the Hugging Face directory a training run or checkpoint stands for.

The result loads in transformers after `import ouro_cli.hf` (our model code), and with the
original remote code where the source had it: config.json (unknown keys kept; `auto_map`
naming only the remote code that travelled), the tokenizer files and the `*.py` remote code
come from the checkpoint's `hf_assets/` (copied there by `ouro convert hf-to-mcore` and by
the trainer). A run directory is read through `RUN/checkpoint/`, at its latest complete
iteration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import JSON_OPTION, OVERWRITE_OPTION
from .convert import MaxShardSize, write_hf_command

EPILOG = """Examples:

  ouro export ./runs/grpo-1 ./export/ouro-1.4b-grpo

  ouro export ./runs/grpo-1/checkpoint ./export/ouro-1.4b-grpo --overwrite --json

  ouro export ./ckpt/ouro-1.4b-mcore ./export/ouro-1.4b --max-shard-size 2GB
"""


def export(
    ckpt_or_run: Annotated[
        Path, typer.Argument(help="Run directory, Megatron checkpoint or HF directory to export.", show_default=False)
    ],
    out: Annotated[Path, typer.Argument(help="Hugging Face directory to create.", show_default=False)],
    max_shard_size: MaxShardSize = "5GB",
    overwrite: bool = OVERWRITE_OPTION,
    json_output: bool = JSON_OPTION,
) -> None:
    """Export a run or checkpoint as a Hugging Face Ouro directory (transformers loads it: `import ouro_cli.hf`)."""
    write_hf_command(
        ckpt_or_run,
        out,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        json_output=json_output,
        command="export",
        source_key="ckpt_or_run",
        label="export",
    )
