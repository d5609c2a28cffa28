"""`ouro train --dry-run`: what a run would do, from the model's config and shapes alone.

A dry run takes the options as `ouro train` resolves them (flags over the TOML file over
the defaults, `auto` resolved for the model), checks the data as a run does before its
model loads (`loop.check_inputs`: the column mapping, the reward's label checks, the
prompt template), checks the options against the model's config (`loop.check_model`),
tokenizes every prompt with the model's tokenizer (`loop.encode_prompts`), and sizes the
memory plan for the device the run would use, the GPU's memory or host memory on CPU
(`loop.memory_plan`, the function the run sizes itself with). It reads the model's
config.json and tokenizer and never its weights (checkpoint/sources.py `assets_dir`), so
it takes seconds at any size; it writes nothing and joins no process group. A run that
would not fit the device still gets its options, data and model reported, with the
reason in place of the memory plan (`memory_error`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ouro_cli.errors import ResourceError

from .options import TrainOptions


@dataclass
class DryRun:
    """The three parts of a dry run's report; `document` is its `--json` form."""

    options: TrainOptions
    data: dict[str, Any]
    model: dict[str, Any]
    memory: dict[str, Any]
    memory_line: str
    memory_error: ResourceError | None = None

    def document(self) -> dict[str, Any]:
        return {
            "dry_run": True,
            "options": self.options.to_dict(),
            "auto": {c.flag: c.value for c in self.options.chosen},
            "data": self.data,
            "model": self.model,
            "memory": self.memory,
            "memory_error": str(self.memory_error) if self.memory_error else None,
        }


def dry_run(options: TrainOptions, gpu_gib: float | None = None) -> DryRun:
    """The report of a run of `options` (module docstring); a problem the run would meet before
    its first rollout is raised as the run would raise it. `gpu_gib`: size the plan for a CUDA
    GPU of that much memory, all of it free (the machine the run is meant for), not this one."""
    from ouro_cli.checkpoint.sources import assets_dir
    from ouro_cli.mcore.process import launched_ranks
    from ouro_cli.model.config import OuroConfig

    from .loop import check_inputs, check_model, encode_prompts, memory_plan, run_device
    from .sizing import DeviceMemory, check_fits, describe, parameter_counts

    rows, eval_rows, _, template = check_inputs(options)
    assets = assets_dir(options.model)
    config = OuroConfig.from_file(assets / "config.json")
    limit = check_model(options, config)
    _, template, prompt_ids, eval_prompt_ids = encode_prompts(
        options, Path(options.model), assets, template, rows, eval_rows, limit
    )
    longest = max(map(len, prompt_ids + eval_prompt_ids))
    seq_tokens = longest + options.sampling.max_response_len
    if gpu_gib is None:
        device = run_device(options)
        memory = DeviceMemory.of(device)
    else:
        trainer = copy.copy(options.trainer)  # not replace(): its checks ask for a visible GPU
        trainer.device = "cuda"
        options = copy.copy(options)
        options.trainer = trainer
        device = f"cuda ({gpu_gib:g} GiB, --dry-run-gpu)"
        memory = DeviceMemory("cuda", int(gpu_gib * 2**30), int(gpu_gib * 2**30))
    dtype = options.trainer.torch_dtype
    try:
        sizing = memory_plan(
            options,
            config,
            memory,
            seq_tokens=seq_tokens,
            prompt_tokens=longest,
            eval_rows=len(eval_rows),
            saved=None,
            world=launched_ranks(),
        )
        check_fits(sizing, memory, 0)
    except ResourceError as err:
        plan, line, error = {}, "memory: no plan fits this device (the error below says why)", err
    else:
        plan, error = sizing.to_dict(), None
        line = describe(
            sizing,
            config,
            memory,
            block_size=options.engine.block_size,
            seq_tokens=seq_tokens,
            dtype=dtype,
            planes=sorted(set(options.depths) | set(options.eval_depths)),
        )
    return DryRun(
        options=options,
        data={
            "rows": len(rows),
            "eval_rows": len(eval_rows),
            "reward_function": options.task.reward_function,
            "prompt_template": template.name,
            "longest_prompt_tokens": longest,
            "seq_tokens": seq_tokens,
        },
        model={
            "path": options.model,
            "config": str(assets / "config.json"),
            "parameters": parameter_counts(config)[0],
            "layers": config.num_hidden_layers,
            "loops": config.num_loops,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_position_embeddings,
            "dtype": str(dtype).removeprefix("torch."),
        },
        memory={"device": str(device), "total_bytes": memory.total, **plan},
        memory_line=line,
        memory_error=error,
    )
