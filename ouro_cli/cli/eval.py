"""`ouro eval MODEL --data F --depths 2 3 4`: held-out accuracy per decode budget K.

Parses the options (`ouro_cli.rl.options.EvalOptions`, flags built from its fields) and
prints the table; the evaluation itself is `ouro_cli.rl.evaluate.run_eval`. One sample
per prompt, seeded per prompt, so two evaluations of different checkpoints with the same
seed are paired comparisons. Writes `evaluations.jsonl` (one line per K),
`manifest.json` and `COMPLETE` into OUT.
"""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from .common import console, run_command
from .options import json_parameter, parameters, with_options

EPILOG = """Examples:

  ouro eval ouro_cli/bundled/tiny/model --data ouro_cli/bundled/tiny/eval.jsonl --depths 1 2 3 4 --prompts 200

  ouro eval runs/grpo-1 --data eval.jsonl --depths 2 3 4 --reward-function ouro_cli.rl.rewards.math_answer --out evals/grpo-1

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
        result = run_eval(options, log=lambda line: console.print(f"[yellow]{escape(line)}[/]", soft_wrap=True))
        _table(result["evaluations"])
        console.print(f"evaluations: {result['out']}/evaluations.jsonl ({result.pop('seconds'):.1f}s)")
        return result

    from ouro_cli.warnings_log import quiet

    run_command(quiet(body, lambda line: console.print(f"[dim]{line}[/]")), json_output=json_output)


def _command():
    from ouro_cli import config as tree
    from ouro_cli.rl.options import EvalOptions

    flags = [p for leaf in tree.leaves(EvalOptions).values() for p in parameters(leaf, panels=False)]
    return with_options(_eval, flags, tail=[json_parameter()])


eval_command = _command()


def _table(results: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="held-out accuracy per K")
    for col in ("K", "prompts", "accuracy", "mean exit depth", "mean tokens", "truncated"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["k"]), str(r["prompts"]), f"{r['accuracy']:.3f}", f"{r['mean_exit_depth']:.2f}",
                      f"{r['mean_tokens']:.1f}", str(r["truncated"]))
    console.print(table)
