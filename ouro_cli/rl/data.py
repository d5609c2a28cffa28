"""Training and evaluation data: rows read through a column mapping, validated whole before
anything else runs.

Rows come from a JSONL file, a Parquet file or a `datasets.save_to_disk` directory
(data_formats.py). `Columns` says where a row holds its three fields; by default they are
our JSONL schema:

    {"prompt": "What is 2+3?", "label": 5, "metadata": {"problem_id": "add-1"}}
    {"prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "label": "\\\\frac{1}{2}"}

- prompt (`--prompt-key`, default `prompt`): a non-empty string (not only whitespace), or
  a non-empty list of chat messages, each an object with a non-empty string `role` and a
  string `content`, with some message carrying non-blank content.
- label (`--label-key`, default `label`): required and not null; any other value. What a
  label must look like is the reward function's business (`rewards.check_labels` runs its
  check up front). `--label-parser gsm8k` first reads GSM8K's "... #### 42" answer text as
  its final number (`gsm8k_label`).
- id (`--id-key`, default `metadata.problem_id`): a string or integer naming the problem in
  rollouts, evaluations and GRPO group checks. When a row has none (or null) it is the row's
  index: its 0-based position among the source's rows (blank JSONL lines are skipped and not
  counted). Ids must be unique (`7` and `"7"` collide). A key other than the default that no
  row has is an error, so a misspelt `--id-key` does not number the rows silently.
- `metadata`: optional object, passed to rewards that take a third argument (`{}` if absent).
- Other fields are allowed and ignored.

A key names a top-level field; when no field is named so, its dots step into nested objects,
so `reward_model.ground_truth` reads verl's Parquet layout (a column literally called
`reward_model.ground_truth`, as `datasets`' `flatten()` writes, is used as it is). Benchmark
files keep their own field names: MATH-500 `--prompt-key problem --label-key answer --id-key
unique_id`; AIME `--prompt-key problem` (or `question`) `--label-key answer --id-key id`;
GSM8K `--prompt-key question --label-key answer --label-parser gsm8k`; verl's DeepScaleR/MATH
Parquet `--label-key reward_model.ground_truth --id-key extra_info.index`.

`load_dataset` reads the whole source before returning and fails with a `UserError` that
names file and line or row (`data.jsonl:7: missing "label"`, `data.parquet:7` for its 7th
row) and how many others are bad, so malformed data stops a run before any model loads;
`scan_dataset` returns every problem instead (`ouro data check`). `data_sha256` is the digest
that goes into the run plan: a resumed run must see byte-identical data.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..bundled import TINY
from ..errors import UserError
from .data_formats import BadRecord, Source, data_sha256, open_source

DEFAULT_ID_KEY = "metadata.problem_id"


@dataclass(frozen=True)
class Row:
    """One validated data row. `line` is its 1-based line in a JSONL file, its 1-based row in a
    Parquet file or dataset (what errors name after the file); `index` is its position among rows."""

    index: int
    line: int
    prompt: str | tuple[dict[str, str], ...]
    label: Any
    problem_id: str | int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)


# ---- label parsers -------------------------------------------------------------------

_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_label(label: Any) -> str:
    """GSM8K's final answer: the number after `#### ` in its answer text, commas removed
    ("... 600 + 600 = <<600+600=1200>>1,200\\n#### 1,200" -> "1200"), as the dataset's
    authors extract it (openai/grade-school-math:grade_school_math/dataset.py,
    `extract_answer`) and verl's GSM8K preprocessing does."""
    if not isinstance(label, str):
        raise ValueError(f"is a {_type_name(label)}, expected GSM8K answer text ending in '#### <number>'")
    match = _GSM8K_ANSWER.search(label)
    if match is None:
        raise ValueError("has no '#### <number>' (--label-parser gsm8k reads GSM8K answer text)")
    return match.group(1).strip().replace(",", "")


# name -> parser (None: the label is used as it is)
LABEL_PARSERS: dict[str, Callable[[Any], Any] | None] = {"none": None, "gsm8k": gsm8k_label}


# ---- the column mapping --------------------------------------------------------------


@dataclass(frozen=True)
class Columns:
    """Where a row holds its prompt, label and id (keys, dots for nested fields), and how its
    label is parsed (a name in LABEL_PARSERS)."""

    prompt: str = "prompt"
    label: str = "label"
    id: str = DEFAULT_ID_KEY
    label_parser: str = "none"

    def replace(
        self,
        prompt: str | None = None,
        label: str | None = None,
        id: str | None = None,
        label_parser: str | None = None,
    ) -> Columns:
        """This mapping with the fields that are given (not None) replaced."""
        given = {"prompt": prompt, "label": label, "id": id, "label_parser": label_parser}
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})

    @property
    def keys(self) -> tuple[str, ...]:
        """Every field a row is read for (a columnar source reads only their columns)."""
        return (self.prompt, self.label, self.id, "metadata")


def check_mapping(flags: dict[str, str | None]) -> None:
    """The mapping flags' values (None: not given), e.g. {"--prompt-key": "problem"}: a key must
    name a field, a label parser must be one of LABEL_PARSERS."""
    for flag, value in flags.items():
        if value is None:
            continue
        if flag.endswith("label-parser"):
            if value not in LABEL_PARSERS:
                raise UserError(f"{flag} must be one of {', '.join(LABEL_PARSERS)}, got {value!r}")
        elif not isinstance(value, str) or not value.strip():
            raise UserError(f"{flag} must name a field of the data rows, got {value!r}")


def columns_for(options: Any, *, held_out: bool = False) -> Columns:
    """The mapping of a run's `--data` (`options.columns`, rl/options.py ColumnOptions), or
    (held_out) of its `--eval-data`, whose own flags (`--eval-prompt-key` ...,
    `options.eval_columns`) default to those of `--data`, except on the bundled held-out set,
    whose fields are our schema's whatever `--data` is (`is_bundled_eval`)."""
    c = options.columns
    columns = Columns(c.prompt_key, c.label_key, c.id_key, c.label_parser)
    if not held_out:
        return columns
    if is_bundled_eval(options.eval_data):
        columns = Columns()
    e = options.eval_columns
    return columns.replace(e.eval_prompt_key, e.eval_label_key, e.eval_id_key, e.eval_label_parser)


def is_bundled_eval(path: str | Path | None) -> bool:
    """Whether `path` is the bundled held-out set (ouro_cli/bundled/tiny/eval.jsonl)."""
    return bool(path) and Path(path).resolve() == (TINY / "eval.jsonl").resolve()


def load_held_out(options: Any) -> list[Row]:
    """The rows of a run's `--eval-data` (none without one); a bad row is a UserError that says
    it is the held-out set and how to map it (its mapping defaults to `--data`'s)."""
    if not options.eval_data:
        return []
    try:
        return load_dataset(options.eval_data, columns_for(options, held_out=True))
    except UserError as err:
        raise UserError(
            f"the held-out set --eval-data: {err}; it is read with --data's column mapping unless "
            "--eval-prompt-key, --eval-label-key, --eval-id-key or --eval-label-parser says otherwise: "
            "give those, or another --eval-data ('' for none)"
        ) from None


# ---- validating a row ----------------------------------------------------------------

_MISSING = object()


def _type_name(value: Any) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        type(None): "null",
        int: "number",
        float: "number",
    }.get(type(value), type(value).__name__)


def _lookup(obj: dict[str, Any], key: str) -> Any:
    """The row's field `key`: the top-level field so named, else the path of its dotted parts
    (_MISSING when a part is absent or null)."""
    if key in obj:
        return obj[key]
    node: Any = obj
    parts = key.split(".")
    for i, part in enumerate(parts):
        if node is None:
            return _MISSING
        if not isinstance(node, dict):
            raise ValueError(f'"{".".join(parts[:i])}" is a {_type_name(node)}, expected an object holding "{part}"')
        if part not in node:
            return _MISSING
        node = node[part]
    return node


def _required(obj: dict[str, Any], key: str, fields: tuple[str, ...] | None) -> Any:
    value = _lookup(obj, key)
    if value is _MISSING:
        shown = list(fields if fields is not None else obj)
        has = ", ".join(shown[:8]) + (", ..." if len(shown) > 8 else "")
        raise ValueError(f'missing "{key}" (the row\'s fields: {has or "none"})')
    return value


def _check_prompt(prompt: Any, key: str = "prompt") -> str | tuple[dict[str, str], ...]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f'empty "{key}"')
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise ValueError(f'empty "{key}" (no messages)')
        messages = []
        for i, message in enumerate(prompt):
            if not isinstance(message, dict):
                raise ValueError(
                    f'"{key}" message {i} is a {_type_name(message)}, expected an object with "role" and "content"'
                )
            for part in ("role", "content"):
                if part not in message:
                    raise ValueError(f'"{key}" message {i} has no "{part}"')
                if not isinstance(message[part], str):
                    raise ValueError(
                        f'"{key}" message {i} "{part}" is a {_type_name(message[part])}, expected a string'
                    )
            if not message["role"].strip():
                raise ValueError(f'"{key}" message {i} has an empty "role"')
            messages.append({"role": message["role"], "content": message["content"]})
        if not any(m["content"].strip() for m in messages):
            raise ValueError(f'empty "{key}" (every message content is blank)')
        return tuple(messages)
    raise ValueError(f'"{key}" is a {_type_name(prompt)}, expected a string or a list of chat messages')


def _parse_row(obj: Any, index: int, line: int, columns: Columns, fields: tuple[str, ...] | None) -> tuple[Row, bool]:
    """The row, and whether it had an id of its own (not its index)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got a {_type_name(obj)}")
    prompt = _check_prompt(_required(obj, columns.prompt, fields), columns.prompt)
    label = _required(obj, columns.label, fields)
    if label is None:
        raise ValueError(f'"{columns.label}" is null')
    parser = LABEL_PARSERS[columns.label_parser]
    if parser is not None:
        try:
            label = parser(label)
        except ValueError as exc:
            raise ValueError(f'"{columns.label}" {exc}') from None
    metadata = obj.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ValueError(f'"metadata" is a {_type_name(metadata)}, expected an object')
    problem_id = _lookup(obj, columns.id)
    own_id = problem_id is not _MISSING and problem_id is not None
    if not own_id:
        problem_id = index
    if isinstance(problem_id, bool) or not isinstance(problem_id, (str, int)):
        raise ValueError(f'"{columns.id}" is a {_type_name(problem_id)}, expected a string or integer')
    if isinstance(problem_id, str) and not problem_id.strip():
        raise ValueError(f'"{columns.id}" is empty')
    return Row(index=index, line=line, prompt=prompt, label=label, problem_id=problem_id, metadata=metadata), own_id


# ---- reading a whole source ----------------------------------------------------------


@dataclass
class DataScan:
    """Everything read from one source: its valid rows and every problem, in source order."""

    source: Source
    records: int = 0  # rows read, bad ones included (blank JSONL lines are not rows)
    rows: list[Row] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # every problem: "name:N: what"
    bad_rows: list[str] = field(default_factory=list)  # the rows that failed validation
    duplicates: dict[str, list[int]] = field(default_factory=dict)  # id -> line/row numbers sharing it
    # bad rows without a label (missing or null): (line/row number, the row's id or None)
    unlabeled: list[tuple[int, Any]] = field(default_factory=list)
    own_ids: int = 0  # valid rows with an id of their own (the others are named by their index)
    file_errors: list[str] = field(default_factory=list)  # problems of the source as a whole

    def first_error(self, errors: list[str] | None = None) -> str:
        """The first problem (of `errors`, default: the scan's), and how many others there are,
        in one line."""
        errors = self.errors if errors is None else errors
        more = len(errors) - 1
        unit = self.source.unit
        return errors[0] + (f" (and {more} more bad {unit}{'s' if more > 1 else ''})" if more else "")


def scan_dataset(path: str | Path, columns: Columns = Columns()) -> DataScan:
    """Every row of the data at `path` read through `columns`, and every problem found."""
    source = open_source(path)
    scan = DataScan(source)
    first_seen: dict[str, int] = {}
    for number, value in source.records(columns.keys):
        index = scan.records
        scan.records += 1
        try:
            if isinstance(value, BadRecord):
                raise ValueError(value.message)
            row, own_id = _parse_row(value, index, number, columns, source.columns)
        except ValueError as exc:
            scan.bad_rows.append(f"{source.name}:{number}: {exc}")
            scan.errors.append(scan.bad_rows[-1])
            if _lacks(value, columns.label):
                scan.unlabeled.append((number, _own_id(value, columns.id)))
            continue
        scan.own_ids += own_id
        key = str(row.problem_id)
        if key in first_seen:
            scan.errors.append(
                f"{source.name}:{number}: problem_id {row.problem_id!r} repeats {source.unit} {first_seen[key]}"
            )
            scan.duplicates.setdefault(key, [first_seen[key]]).append(number)
        first_seen.setdefault(key, number)
        scan.rows.append(row)
    if scan.rows and not scan.own_ids and columns.id != DEFAULT_ID_KEY:
        scan.file_errors.append(
            f'{source.name}: no row has the id key "{columns.id}"; name a field the rows '
            "have (or leave --id-key out to number the rows)"
        )
        scan.errors.append(scan.file_errors[-1])
    return scan


def _lacks(obj: Any, key: str) -> bool:
    """Whether a row (a JSON object) has no value, or null, at `key`."""
    if not isinstance(obj, dict):
        return False
    try:
        value = _lookup(obj, key)
    except ValueError:  # a part of the path is not an object: no value there either
        return True
    return value is _MISSING or value is None


def _own_id(obj: dict[str, Any], key: str) -> Any:
    """A bad row's id when it has a string or integer one, else None."""
    try:
        value = _lookup(obj, key)
    except ValueError:
        return None
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def load_dataset(path: str | Path, columns: Columns = Columns()) -> list[Row]:
    """Every row of the data at `path`, or a UserError naming the first bad line or row."""
    scan = scan_dataset(path, columns)
    if scan.errors:
        raise UserError(scan.first_error())
    if not scan.rows:
        raise UserError(f"{scan.source.name}: no data rows (the file is empty)")
    return scan.rows


__all__ = [
    "Columns",
    "DEFAULT_ID_KEY",
    "DataScan",
    "LABEL_PARSERS",
    "Row",
    "check_mapping",
    "columns_for",
    "data_sha256",
    "gsm8k_label",
    "is_bundled_eval",
    "load_dataset",
    "load_held_out",
    "scan_dataset",
]
