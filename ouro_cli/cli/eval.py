"""`ouro eval MODEL --data F --depths 2 3 4`: held-out accuracy per decode budget K.

Runs the rollout engine on the checkpoint (HF, Megatron or a run directory) and grades
each response with the reward plugin; one sample per prompt, seeded per prompt, so two
evaluations of different checkpoints with the same seed are paired comparisons.
Writes `evaluations.jsonl` (one line per K), `manifest.json` and `COMPLETE` into OUT.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ouro_cli.rl.data import Columns

from .common import JSON_OPTION, OVERWRITE_OPTION, console, run_command

EPILOG = """Examples:

  ouro eval ouro_cli/bundled/tiny/model --data ouro_cli/bundled/tiny/eval.jsonl --depths 1 2 3 4 --prompts 200

  ouro eval runs/grpo-1 --data eval.jsonl --depths 2 3 4 --reward-function ouro_cli.rl.rewards.math_answer --out evals/grpo-1

  ouro eval runs/grpo-1 --data math500.parquet --prompt-key problem \\
      --label-key answer --id-key unique_id \\
      --reward-function ouro_cli.rl.rewards.math_answer
"""


def eval_command(
    model: Annotated[str, typer.Argument(help="HF directory, Megatron checkpoint or run directory.", show_default=False)],
    data: Annotated[str, typer.Option("--data", help="Held-out data: JSONL, Parquet or a datasets save_to_disk directory.")],
    prompt_key: Annotated[str, typer.Option("--prompt-key", help="Field of a row holding the prompt; dots reach into nested fields.")] = Columns.prompt,
    label_key: Annotated[str, typer.Option("--label-key", help="Field holding the label, e.g. answer or reward_model.ground_truth.")] = Columns.label,
    id_key: Annotated[str, typer.Option("--id-key", help="Field holding the problem id (a row without one: its index).")] = Columns.id,
    label_parser: Annotated[str, typer.Option("--label-parser", help="none, or gsm8k: the label is the number after '####' in GSM8K's answer text.")] = Columns.label_parser,
    depths: Annotated[list[int] | None, typer.Option("--depths", help="Decode budgets K to evaluate: --depths 2 3 4. \\[default: 2 3 4]")] = None,
    prompts: Annotated[int, typer.Option("--prompts", help="Evaluate the first N prompts.")] = 64,
    reward_function: Annotated[str, typer.Option("--reward-function", help="Dotted path of f(response, label) -> float.")] = "ouro_cli.rl.rewards.boxed_answer",
    prompt_template: Annotated[str, typer.Option("--prompt-template", help="chatml, raw or tokenizer.")] = "chatml",
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature.")] = 1.0,
    max_response_len: Annotated[int, typer.Option("--max-response-len", help="Tokens per response.")] = 48,
    exit_threshold: Annotated[float, typer.Option("--exit-threshold", help="Native early exit threshold (1 = exactly K loops).")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 1234,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="Sequences decoded together.")] = 64,
    out: Annotated[Path | None, typer.Option("--out", help="Output directory (outside every input). \\[default: evals/ouro-eval-<timestamp>]")] = None,
    overwrite: bool = OVERWRITE_OPTION,
    json_output: bool = JSON_OPTION,
) -> None:
    """Evaluate a checkpoint's held-out accuracy per decode budget K."""

    def body() -> dict[str, Any]:
        from ouro_cli import artifacts
        from ouro_cli.errors import UserError
        from ouro_cli.rl.data import check_mapping, load_dataset
        from ouro_cli.rl.rewards import check_labels, load_reward
        from ouro_cli.rl.template import template_for_checkpoint

        if prompts < 1 or max_response_len < 1 or not temperature > 0:
            raise UserError("--prompts and --max-response-len must be >= 1 and --temperature > 0")
        check_mapping({"--prompt-key": prompt_key, "--label-key": label_key, "--id-key": id_key,
                       "--label-parser": label_parser})
        rows = load_dataset(data, Columns(prompt_key, label_key, id_key, label_parser))[:prompts]
        reward_fn = load_reward(reward_function)
        check_labels(reward_fn, reward_function, [(f"{data}:{r.line}", r.label) for r in rows])
        target = out or Path(f"evals/ouro-eval-{time.strftime('%Y%m%d-%H%M%S')}")
        artifacts.check_output_dir(target, overwrite, inputs=[data])

        import torch

        from ouro_cli.checkpoint import open_checkpoint
        from ouro_cli.checkpoint.sources import unfinished_run_note
        from ouro_cli.engine import LLM
        from ouro_cli.engine.tokenizer import TextCodec
        from ouro_cli.mcore import single_process_group
        from ouro_cli.model import from_state_dict
        from ouro_cli.rl.evaluate import evaluate
        from ouro_cli.rl.loop import stop_tokens_for, tokenize_prompts
        from ouro_cli.rl.metrics import append_jsonl
        from ouro_cli.rl.schedule import validate_depths

        dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        with single_process_group():
            source = open_checkpoint(model)
            artifacts.check_output_dir(target, overwrite, inputs=[data, *source.input_paths])
            note = unfinished_run_note(model)
            if note:
                console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
            ks = validate_depths(depths or [2, 3, 4], source.config.num_loops)
            codec = TextCodec.from_dir(source.assets_dir)
            if codec is None:
                raise UserError(f"{model} has no tokenizer.json")
            template = template_for_checkpoint(prompt_template, source.assets_dir)
            prompt_ids = tokenize_prompts(codec, template, rows, source.config.max_position_embeddings, max_response_len, data)
            net = from_state_dict(source.config, dict(source.iter_tensors()), device=dev)
        engine = LLM(net, max_num_seqs=max_num_seqs)
        start = time.perf_counter()
        results = evaluate(engine, rows, prompt_ids, ks=ks, num_loops=source.config.num_loops, reward_fn=reward_fn,
                           seed=seed, temperature=temperature, max_tokens=max_response_len,
                           exit_threshold=exit_threshold, min_loops=1, stop_token_ids=stop_tokens_for(source.config, codec),
                           decode=codec.decode)
        engine.close()
        with artifacts.staged_output(target, overwrite=overwrite, inputs=[data, *source.input_paths]) as staging:
            from ouro_cli.warnings_log import attach_active

            attach_active(staging / "logs" / "warnings.log", shown=target / "logs" / "warnings.log")
            for r in results:
                append_jsonl(staging / "evaluations.jsonl", {"model": str(model), **r})
            artifacts.write_manifest(staging, "ouro eval", {
                "model": model, "data": data, "prompt_key": prompt_key, "label_key": label_key, "id_key": id_key,
                "label_parser": label_parser, "depths": ks, "prompts": prompts, "reward_function": reward_function,
                "prompt_template": prompt_template, "temperature": temperature, "max_response_len": max_response_len,
                "exit_threshold": exit_threshold, "seed": seed, "device": dev}, [Path(data)])
            artifacts.mark_complete(staging)
        _table(results)
        console.print(f"evaluations: {target / 'evaluations.jsonl'} ({time.perf_counter() - start:.1f}s)")
        return {"out": str(target), "evaluations": results, **({"note": note} if note else {})}

    from ouro_cli.warnings_log import quiet

    run_command(quiet(body, lambda line: console.print(f"[dim]{line}[/]")), json_output=json_output)


def _table(results: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="held-out accuracy per K")
    for col in ("K", "prompts", "accuracy", "mean exit depth", "mean tokens", "truncated"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["k"]), str(r["prompts"]), f"{r['accuracy']:.3f}", f"{r['mean_exit_depth']:.2f}",
                      f"{r['mean_tokens']:.1f}", str(r["truncated"]))
    console.print(table)
