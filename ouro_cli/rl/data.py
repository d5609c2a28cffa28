"""Training and evaluation data: JSONL rows, validated whole before anything else runs.

One JSON object per line:

    {"prompt": "What is 2+3?", "label": 5, "metadata": {"problem_id": "add-1"}}
    {"prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "label": "\\\\frac{1}{2}"}

- `prompt`: a non-empty string (not only whitespace), or a non-empty list of chat
  messages, each an object with a non-empty string `role` and a string `content`,
  with some message carrying non-blank content.
- `label`: required and not null; any other JSON value. What a label must look like is
  the reward function's business (`rewards.check_labels` runs its check up front).
- `metadata`: optional object. `metadata.problem_id` (string or integer) names the
  problem in rollouts, evaluations and GRPO group checks. When absent it defaults to
  the row's index: the 0-based position of the row among the file's rows (blank lines
  are skipped and not counted). Problem ids must be unique (`7` and `"7"` collide).
- Other top-level keys are allowed and ignored.

`load_dataset` reads the whole file before returning and fails with a `UserError` that
names file and line (`data.jsonl:7: missing "label"`) and how many other lines are bad,
so malformed data stops a run before any model loads. `data_sha256` is the digest that
goes into the run plan: a resumed run must see byte-identical data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError


@dataclass(frozen=True)
class Row:
    """One validated data row. `line` is 1-based in the file; `index` is its position among rows."""

    index: int
    line: int
    prompt: str | tuple[dict[str, str], ...]
    label: Any
    problem_id: str | int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(value), type(value).__name__)


def _check_prompt(prompt: Any) -> str | tuple[dict[str, str], ...]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError('empty "prompt"')
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise ValueError('empty "prompt" (no messages)')
        messages = []
        for i, message in enumerate(prompt):
            if not isinstance(message, dict):
                raise ValueError(f'"prompt" message {i} is a {_type_name(message)}, expected an object with "role" and "content"')
            for key in ("role", "content"):
                if key not in message:
                    raise ValueError(f'"prompt" message {i} has no "{key}"')
                if not isinstance(message[key], str):
                    raise ValueError(f'"prompt" message {i} "{key}" is a {_type_name(message[key])}, expected a string')
            if not message["role"].strip():
                raise ValueError(f'"prompt" message {i} has an empty "role"')
            messages.append({"role": message["role"], "content": message["content"]})
        if not any(m["content"].strip() for m in messages):
            raise ValueError('empty "prompt" (every message content is blank)')
        return tuple(messages)
    raise ValueError(f'"prompt" is a {_type_name(prompt)}, expected a string or a list of chat messages')


def _parse_row(text: str, index: int, line: int) -> Row:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"bad JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got a {_type_name(obj)}")
    if "prompt" not in obj:
        raise ValueError('missing "prompt"')
    prompt = _check_prompt(obj["prompt"])
    if "label" not in obj:
        raise ValueError('missing "label"')
    if obj["label"] is None:
        raise ValueError('"label" is null')
    metadata = obj.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ValueError(f'"metadata" is a {_type_name(metadata)}, expected an object')
    problem_id = metadata.get("problem_id", index)
    if isinstance(problem_id, bool) or not isinstance(problem_id, (str, int)):
        raise ValueError(f'"metadata.problem_id" is a {_type_name(problem_id)}, expected a string or integer')
    if isinstance(problem_id, str) and not problem_id.strip():
        raise ValueError('"metadata.problem_id" is empty')
    return Row(index=index, line=line, prompt=prompt, label=obj["label"], problem_id=problem_id, metadata=metadata)


def load_dataset(path: str | Path) -> list[Row]:
    """Every row of the JSONL file at `path`, or a UserError naming the first bad line."""
    name = str(path)
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data file {name} does not exist" if not path.exists() else f"data file {name} is not a file")
    data = path.read_bytes()
    rows: list[Row] = []
    errors: list[str] = []
    seen_ids: dict[str, int] = {}
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # UTF-8 byte-order mark
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            errors.append(f"{name}:{line_no}: not UTF-8 (byte {exc.start + 1})")
            continue
        if not text.strip():
            continue
        try:
            row = _parse_row(text, len(rows), line_no)
        except ValueError as exc:
            errors.append(f"{name}:{line_no}: {exc}")
            rows.append(None)  # type: ignore[arg-type]  # keep later rows' default ids stable
            continue
        key = str(row.problem_id)
        if key in seen_ids:
            errors.append(f"{name}:{line_no}: problem_id {row.problem_id!r} repeats line {seen_ids[key]}")
        seen_ids.setdefault(key, line_no)
        rows.append(row)
    if errors:
        more = f" (and {len(errors) - 1} more bad line{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        raise UserError(errors[0] + more)
    if not rows:
        raise UserError(f"{name}: no data rows (the file is empty)")
    return rows


def data_sha256(path: str | Path) -> str:
    """sha256 of the data file's bytes, as recorded in the run plan."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


__all__ = ["Row", "data_sha256", "load_dataset"]
