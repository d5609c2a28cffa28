"""`ouro data check FILE [...]`: what `ouro train` / `ouro eval` would read from each data file.

Each file (JSONL, Parquet or a datasets directory) is read through the same column mapping
as training (`--prompt-key`, `--label-key`, `--id-key`, `--label-parser`; ouro_cli.rl.data)
and described: its format, how many rows, prompt-length percentiles (in tokens of the
prompt as training renders it, with the template, when `--model` names the checkpoint
whose tokenizer to use; in characters otherwise), where the ids come from and which are
duplicated, the first bad row and the rows without a label, and the first valid row as
training sees it: its prompt rendered by the template and its label as parsed. Prompts are
validated as training validates them (rl/prompts.py): a chat role the template does not
know, and with `--model` a prompt that leaves no room for `--max-response-len` tokens, is an
error with training's line. `--reward-function` also runs the reward's label check, as
training does before any model loads (`auto`: the grader `ouro train` would pick for the file).

Exit 0 when every file would load; 2 when any would not, with one error line naming the
first problem. `--json` prints the report on stdout either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import typer

from ouro_cli import defaults
from ouro_cli.rl.data import Columns
from ouro_cli.rl.options import AUTO_REWARD

from .commands import Command
from .common import JSON_OPTION, report_console, rich_escape, run_command

GROUP_EPILOG = """Examples:

  ouro data check train.jsonl eval.jsonl       # our JSONL schema

  ouro data check math500.parquet --prompt-key problem --label-key answer \\
      --id-key unique_id
"""

CHECK_EPILOG = """Examples:

  ouro data check ouro_cli/bundled/tiny/train.jsonl \\
      --model ouro_cli/bundled/tiny/model                 # lengths in tokens

  ouro data check gsm8k/test --prompt-key question --label-key answer \\
      --label-parser gsm8k --json                         # a datasets directory

  ouro data check deepscaler.parquet --label-key reward_model.ground_truth \\
      --id-key extra_info.index --model ./Ouro-1.4B \\
      --reward-function ouro_cli.rl.rewards.math_answer   # verl Parquet
"""

app = typer.Typer(
    name="data",
    help="Inspect training and evaluation data before a run.",
    epilog=GROUP_EPILOG,
    no_args_is_help=True,
    rich_markup_mode="rich",
)

P_MAP, P_LEN = "Column mapping", "Prompt lengths and labels"
PERCENTILES = (50, 90, 99)
SHOWN_DUPLICATES = 5
SHOWN_UNLABELED = 5


@app.command("check", epilog=CHECK_EPILOG, cls=Command)
def check(
    files: Annotated[
        list[str],
        typer.Argument(help="Data files: JSONL, Parquet, or datasets save_to_disk directories.", show_default=False),
    ],
    prompt_key: Annotated[
        str,
        typer.Option(
            "--prompt-key",
            help="Field of a row holding the prompt; dots reach into nested fields.",
            rich_help_panel=P_MAP,
        ),
    ] = Columns.prompt,
    label_key: Annotated[
        str,
        typer.Option(
            "--label-key",
            help="Field holding the label, e.g. answer or reward_model.ground_truth.",
            rich_help_panel=P_MAP,
        ),
    ] = Columns.label,
    id_key: Annotated[
        str,
        typer.Option(
            "--id-key", help="Field holding the problem id (a row without one: its index).", rich_help_panel=P_MAP
        ),
    ] = Columns.id,
    label_parser: Annotated[
        str,
        typer.Option(
            "--label-parser",
            help="none, or gsm8k: the label is the number after '####' in GSM8K's answer text.",
            rich_help_panel=P_MAP,
        ),
    ] = Columns.label_parser,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="Checkpoint (HF, Megatron or run directory) whose tokenizer measures prompts in tokens. \\[default: "
            "none: characters]",
            rich_help_panel=P_LEN,
        ),
    ] = None,
    prompt_template: Annotated[
        str,
        typer.Option(
            "--prompt-template",
            help="chatml, raw or tokenizer: how prompts are rendered before they are measured (needs --model).",
            rich_help_panel=P_LEN,
        ),
    ] = "chatml",
    max_response_len: Annotated[
        int | None,
        typer.Option(
            "--max-response-len",
            help="With --model: refuse a prompt that leaves no room for this many response tokens, as training does. "
            f"\\[default: auto, as ouro train's: {defaults.help_for('max_response_len').removeprefix('auto: ')}]",
            rich_help_panel=P_LEN,
            show_default=False,
        ),
    ] = None,
    reward_function: Annotated[
        str | None,
        typer.Option(
            "--reward-function",
            help="Also run this reward's label check on every row; auto: the grader ouro train picks for the "
            "file. \\[default: none]",
            rich_help_panel=P_LEN,
        ),
    ] = None,
    json_output: bool = JSON_OPTION,
) -> None:
    """Count the rows, measure the prompts, find duplicate ids and bad rows of data files."""

    def body() -> dict[str, Any]:
        from ouro_cli.errors import UserError
        from ouro_cli.rl.data import check_mapping

        check_mapping(
            {"--prompt-key": prompt_key, "--label-key": label_key, "--id-key": id_key, "--label-parser": label_parser}
        )
        columns = Columns(prompt_key, label_key, id_key, label_parser)
        response_len = max_response_len
        if response_len is None and model is not None:  # auto, as ouro train's (ouro_cli/defaults.py)
            response_len = defaults.recipe_for(model).max_response_len
        measure = _measure(model, prompt_template, response_len or 0)
        if reward_function not in (None, AUTO_REWARD):
            from ouro_cli.rl.rewards import load_reward

            load_reward(reward_function)  # a bad path is one line, before any file is read
        reports = [_check_file(path, columns, measure, _reward_for(reward_function, path)) for path in files]
        for report in reports:
            _print(report, report_console(json_output))  # the command's product: stdout
        result = {
            "files": reports,
            "columns": {
                "prompt_key": prompt_key,
                "label_key": label_key,
                "id_key": id_key,
                "label_parser": label_parser,
            },
        }
        failed = [r for r in reports if not r["ok"]]
        if failed:
            more = (
                f"; {len(failed) - 1} more file{'s' if len(failed) > 2 else ''} with errors" if len(failed) > 1 else ""
            )
            err = UserError(failed[0]["first_error"] + more)
            err.result = result  # the report goes into --json's document as well
            raise err
        return result

    run_command(body, json_output=json_output)


@dataclass
class _Measure:
    """How prompts are checked and their lengths counted: in characters against the template's
    rules, or, with a checkpoint's tokenizer, as training tokenises them (rl/prompts.py), so
    a prompt training refuses is refused here with the same line."""

    template: Any
    unit: str = "characters"
    codec: Any = None
    limit: int | None = None  # the model's max_position_embeddings
    max_response_len: int = 0

    def lengths(self, rows: list[Any], path: str) -> list[int]:
        """Each row's prompt length, or the UserError training would raise for the first bad one."""
        self.template.check([(f"{path}:{r.line}", r.prompt) for r in rows])
        if self.codec is None:
            from ouro_cli.rl.template import as_messages

            return [sum(len(m["content"]) for m in as_messages(r.prompt)) for r in rows]
        from ouro_cli.rl.prompts import tokenize_prompts

        return [
            len(ids)
            for ids in tokenize_prompts(self.codec, self.template, rows, self.limit, self.max_response_len, path)
        ]


def _measure(model: str | None, prompt_template: str, max_response_len: int) -> _Measure:
    from ouro_cli.errors import UserError
    from ouro_cli.rl.template import TEMPLATE_NAMES, get_template

    if prompt_template not in TEMPLATE_NAMES:
        raise UserError(f"--prompt-template must be one of {', '.join(TEMPLATE_NAMES)}, got {prompt_template!r}")
    if model is None:
        if prompt_template != "chatml":
            raise UserError("--prompt-template needs --model: prompts are measured in the model's tokens")
        return _Measure(get_template(prompt_template))
    from ouro_cli.checkpoint import open_checkpoint
    from ouro_cli.engine.tokenizer import TextCodec
    from ouro_cli.rl.template import template_for_checkpoint

    source = open_checkpoint(model)
    codec = TextCodec.from_dir(source.assets_dir)
    if codec is None:
        raise UserError(f"{model} has no tokenizer.json")
    return _Measure(
        template_for_checkpoint(prompt_template, source.assets_dir),
        "tokens",
        codec,
        source.config.max_position_embeddings,
        max_response_len,
    )


def _reward_for(reward_function: str | None, path: str) -> str | None:
    """The reward whose label check runs on the file at `path` (`auto`: as `ouro train` resolves it)."""
    if reward_function != AUTO_REWARD:
        return reward_function
    from ouro_cli.rl.options import auto_reward

    return auto_reward(path)


def _check_file(path: str, columns: Columns, measure: _Measure, reward_function: str | None) -> dict[str, Any]:
    import numpy as np

    from ouro_cli.errors import UserError
    from ouro_cli.rl.data import scan_dataset

    try:
        scan = scan_dataset(path, columns)
    except UserError as err:  # the file as a whole: missing, unreadable, a datasets directory without datasets
        return {"path": path, "ok": False, "first_error": str(err), "errors": 1, "other_errors": [str(err)]}
    others = list(scan.file_errors)  # problems besides bad rows and duplicate ids
    if not scan.records:
        others.append(f"{scan.source.name}: no data rows (the file is empty)")
    lengths: list[int] = []
    try:
        lengths = measure.lengths(scan.rows, path)
    except UserError as err:
        others.append(str(err))
    if reward_function is not None:
        from ouro_cli.rl.rewards import check_labels, load_reward

        try:
            check_labels(
                load_reward(reward_function), reward_function, [(f"{path}:{r.line}", r.label) for r in scan.rows]
            )
        except UserError as err:
            others.append(str(err))
    errors = scan.errors + [e for e in others if e not in scan.errors]
    report: dict[str, Any] = {
        "path": path,
        "format": scan.source.format,
        "rows": scan.records,
        "valid_rows": len(scan.rows),
        "bad_rows": len(scan.bad_rows),
        "first_bad_row": scan.bad_rows[0] if scan.bad_rows else None,
        "ids": {"key": columns.id, "own": scan.own_ids, "row_index": len(scan.rows) - scan.own_ids},
        "duplicate_ids": [{"id": key, scan.source.unit + "s": numbers} for key, numbers in scan.duplicates.items()],
        "unlabeled": {
            "key": columns.label,
            "rows": len(scan.unlabeled),
            "first": [{scan.source.unit: n, "id": i} for n, i in scan.unlabeled[:SHOWN_UNLABELED]],
        },
        "reward_function": reward_function,
        "example": _example(scan.rows, measure, scan.source.unit),
        "other_errors": others,
        "errors": len(errors),
        "ok": not errors,
        "first_error": scan.first_error(errors) if errors else None,  # the line `ouro train` would print
    }
    if lengths:
        values = np.percentile(lengths, PERCENTILES, method="inverted_cdf")
        report["prompt_length"] = {
            "unit": measure.unit,
            "min": min(lengths),
            "max": max(lengths),
            **{f"p{q}": int(v) for q, v in zip(PERCENTILES, values, strict=True)},
        }
        if measure.limit is not None:
            report["prompt_length"]["model_limit"] = measure.limit
    return report


def _example(rows: list[Any], measure: _Measure, unit: str) -> dict[str, Any] | None:
    """The first valid row as training sees it: its prompt rendered by the template, its label
    as parsed (None when no row is valid or the template cannot render it)."""
    from ouro_cli.errors import UserError

    if not rows:
        return None
    row = rows[0]
    try:
        prompt = measure.template.render(row.prompt)
    except UserError:  # e.g. chat messages under `raw`: reported as an error already
        return None
    return {
        unit: row.line,
        "id": row.problem_id,
        "template": measure.template.name,
        "prompt": prompt,
        "label": row.label,
    }


def _print(report: dict[str, Any], out) -> None:
    def say(text: str) -> None:
        out.print(text, soft_wrap=True)  # a line per fact, as a log keeps it

    path = rich_escape(report["path"])
    if "format" not in report:
        say(f"[bold]{path}[/]: [red]{rich_escape(report['first_error'])}[/]")
        return
    say(f"[bold]{path}[/]: {report['format']}, {report['rows']} rows ({report['valid_rows']} valid)")
    lengths = report.get("prompt_length")
    if lengths:
        shown = "  ".join(f"{k} {lengths[k]}" for k in ("min", *(f"p{q}" for q in PERCENTILES), "max"))
        limit = f" (the model's limit: {lengths['model_limit']})" if "model_limit" in lengths else ""
        say(f"  prompt length in {lengths['unit']}: {shown}{limit}")
    ids = report["ids"]
    source = f"{ids['own']} from {rich_escape(ids['key'])}" + (
        f", {ids['row_index']} by row index" if ids["row_index"] else ""
    )
    dups = report["duplicate_ids"]
    if dups:
        unit = next(k for k in dups[0] if k != "id")
        listed = ", ".join(f"{d['id']!r} ({unit} {', '.join(map(str, d[unit]))})" for d in dups[:SHOWN_DUPLICATES])
        more = ", ..." if len(dups) > SHOWN_DUPLICATES else ""
        say(f"  ids: {source}; [red]{len(dups)} duplicated[/]: {rich_escape(listed)}{more}")
    else:
        say(f"  ids: {source}, all distinct")
    if report["first_bad_row"]:
        say(f"  [red]bad rows: {report['bad_rows']}[/]; the first: {rich_escape(report['first_bad_row'])}")
    else:
        say("  bad rows: none")
    if report["unlabeled"]["rows"]:
        say(_unlabeled_line(report["unlabeled"]))
    for error in report["other_errors"]:
        say(f"  [red]{rich_escape(error)}[/]")
    if report["example"]:
        for line in _example_lines(report["example"]):
            say(line)
    if report["reward_function"]:
        say(f"  labels checked by {rich_escape(report['reward_function'])}")


def _unlabeled_line(unlabeled: dict[str, Any]) -> str:
    """How many rows lack a label, and the first of them (line or row, and id when they have one)."""
    unit = next(k for k in unlabeled["first"][0] if k != "id")
    listed = ", ".join(
        f"{unit} {r[unit]}" + (f" (id {r['id']!r})" if r["id"] is not None else "") for r in unlabeled["first"]
    )
    more = ", ..." if unlabeled["rows"] > len(unlabeled["first"]) else ""
    key = rich_escape(unlabeled["key"])
    return f'  [red]rows without a label "{key}": {unlabeled["rows"]}[/]; the first: {rich_escape(listed)}{more}'


def _example_lines(example: dict[str, Any]) -> list[str]:
    """The first valid row: where it is, its prompt as rendered (indented), its label as JSON."""
    import json

    unit = next(k for k in example if k not in ("id", "template", "prompt", "label"))
    where = rich_escape(f"{unit} {example[unit]}, id {example['id']!r}")
    label = json.dumps(example["label"], ensure_ascii=False, default=str)
    return [
        f"  first valid row ({where}) as the model gets it, {example['template']} template:",
        rich_escape("\n".join("    " + line for line in example["prompt"].splitlines())),
        f"  its label, as the reward gets it: {rich_escape(label)}",
    ]
