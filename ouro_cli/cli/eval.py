"""`ouro eval MODEL --data F --depths 2 3 4`: held-out accuracy per decode budget K.

Parses the options (`ouro_cli.rl.options.EvalOptions`, flags built from its fields) and
prints the table; the evaluation itself is `ouro_cli.rl.evaluate.run_eval`. `--samples N`
samples per prompt (default 1), seeded per (prompt, sample), so two evaluations of different
checkpoints with the same seed are paired comparisons; with N > 1 the table shows avg@N and
pass@k. Writes `evaluations.jsonl` (one line per K), `responses.jsonl` (one line per K,
prompt and sample), `manifest.json` and `COMPLETE` into OUT.
"""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from .common import console, report_console, run_command
from .options import json_parameter, parameters, with_options

EPILOG = """Examples:

  ouro eval ouro_cli/bundled/tiny/model --data ouro_cli/bundled/tiny/eval.jsonl --depths 1 2 3 4 --prompts 200

  ouro eval runs/grpo-1 --data eval.jsonl --depths 2 3 4 \\
      --reward-function ouro_cli.rl.rewards.math_answer --out evals/grpo-1

  ouro eval runs/grpo-1 --data eval.jsonl --samples 8     # avg@8 and pass@k

  ouro eval runs/grpo-fp8 --data eval.jsonl --kv-cache-dtype fp8   # a policy trained with an fp8 KV cache

  ouro eval runs/grpo-1 --data math500.parquet --prompt-key problem \\
      --label-key answer --id-key unique_id \\
      --reward-function ouro_cli.rl.rewards.math_answer
"""


def _eval(json_output: bool, **flags: Any) -> None:
    """Evaluate a checkpoint's held-out accuracy per decode budget K."""

    def body() -> dict[str, Any]:
        from ouro_cli import config as tree
        from ouro_cli.rl.evaluate import run_eval
        from ouro_cli.rl.options import EvalOptions
        from ouro_cli.settings import from_environment

        given = {k: (v or None) if isinstance(v, list) else v for k, v in flags.items()}
        values = {**from_environment(EvalOptions), **{k: v for k, v in given.items() if v is not None}}
        options = tree.build(EvalOptions, values, check=False).validate()
        for choice in options.chosen:
            console.print(escape(choice.note), soft_wrap=True)
        result = run_eval(options, log=lambda line: console.print(f"[yellow]{escape(line)}[/]", soft_wrap=True))
        out = report_console(json_output)  # the command's product: stdout
        _table(result["evaluations"], out)
        out.print(f"evaluations: {result['out']}/evaluations.jsonl ({result.pop('seconds'):.1f}s)")
        out.print(f"responses: {result['responses']}")
        return result

    from ouro_cli.warnings_log import quiet

    run_command(quiet(body, lambda line: console.print(f"[dim]{line}[/]")), json_output=json_output)


def _command():
    from ouro_cli import config as tree
    from ouro_cli.rl.options import EvalOptions

    flags = [p for leaf in tree.leaves(EvalOptions).values() for p in parameters(leaf, panels=False)]
    return with_options(_eval, flags, tail=[json_parameter()])


eval_command = _command()


def _table(results: list[dict[str, Any]], out) -> None:
    """One row per K. With N samples per prompt the accuracy column is avg@N, and a second
    table gives pass@k per K (a table of its own, so that pass@1 … pass@64 fit 80 columns)."""
    from rich.table import Table

    samples = results[0].get("samples", 1) if results else 1
    title = "held-out accuracy per K" + (f", {samples} samples per prompt" if samples > 1 else "")
    table = Table(title=title)
    for col in (
        "K",
        "prompts",
        "accuracy" if samples == 1 else f"avg@{samples}",
        "mean exit depth",
        "mean tokens",
        "truncated",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r["k"]),
            str(r["prompts"]),
            f"{r['accuracy']:.3f}",
            f"{r['mean_exit_depth']:.2f}",
            f"{r['mean_tokens']:.1f}",
            str(r["truncated"]),
        )
    out.print(table)
    if samples == 1:
        return
    passes = [key for key in results[0] if key.startswith("pass@")]
    table = Table(title=f"pass@k per K (unbiased, from {samples} samples per prompt)")
    for col in ("K", *passes):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["k"]), *(f"{r[key]:.3f}" for key in passes))
    out.print(table)
