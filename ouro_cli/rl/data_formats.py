"""Where data rows come from: a JSONL file, a Parquet file, or a `datasets` directory.

`open_source(path)` tells the three apart by what `path` is, not by its name:

- a directory is one written by `datasets.save_to_disk` (it holds `state.json`, or
  `dataset_dict.json` for a DatasetDict, whose single split is used; with several splits
  the path must name one, e.g. `gsm8k/test`). Reading it needs the `datasets` library, an
  optional extra (`pip install 'ouro-cli[hf]'`); without it the path is one line saying so.
- a file that starts with Parquet's magic bytes `PAR1`, or is named `*.parquet`, is read
  with pyarrow, batch by batch;
- any other file is JSONL: one JSON value per line, blank lines skipped.

A source yields records `(number, value)`: `number` is what an error names after the file,
the 1-based line of a JSONL file (`data.jsonl:7`), the 1-based row of a Parquet file or a
dataset (`data.parquet:7` is its seventh row, pandas' `df.iloc[6]`). `value` is the row as
plain Python (Parquet structs are dicts, lists are lists, nulls are None), or a `BadRecord`
for a line that is not JSON. Columnar sources read only the columns the caller names, so a
wide dataset (solutions, generations) costs only the columns a run uses.

`data_sha256` is the digest the run plan records: the bytes of a file, or every file of a
dataset directory (relative path and content), so a resumed run must see the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError

PARQUET_MAGIC = b"PAR1"
BATCH_ROWS = 1024
HF_HINT = "pip install 'ouro-cli[hf]' (or pip install datasets)"


@dataclass(frozen=True)
class BadRecord:
    """A record that is not a value at all (a JSONL line that is not UTF-8 or not JSON)."""

    message: str


@dataclass(frozen=True)
class Source:
    """One data input, its format known and its file-level problems already reported."""

    path: Path
    name: str  # as the user wrote it: errors say `{name}:{number}`
    format: str  # "jsonl", "parquet" or "datasets"
    columns: tuple[str, ...] | None = None  # top-level column names of a columnar source

    @property
    def unit(self) -> str:
        """What a record's number counts: lines of a JSONL file, rows otherwise."""
        return "line" if self.format == "jsonl" else "row"

    def records(self, keys: Iterable[str] = ()) -> Iterator[tuple[int, Any]]:
        """Every record, in order. `keys` (dotted row keys) say which columns a columnar source
        reads: a key's own column when one is named so, else the column of its first part."""
        if self.format == "jsonl":
            return _jsonl_records(self.path, self.name)
        # no column matching a key still reads one, so that every row is counted (and is missing them)
        wanted = _columns_for(self.columns or (), keys) or list(self.columns or ())[:1]
        if self.format == "parquet":
            return _parquet_records(self.path, self.name, wanted)
        return _dataset_records(self.path, self.name, wanted)


def open_source(path: str | Path) -> Source:
    """The data input at `path`, or a UserError saying what is wrong with it as a whole."""
    name = str(path)
    path = Path(path)
    if not path.exists():
        raise UserError(f"data file {name} does not exist")
    if path.is_dir():
        return _open_dataset_dir(path, name)
    if not path.is_file():
        raise UserError(f"data file {name} is not a file")
    with open(path, "rb") as f:
        magic = f.read(len(PARQUET_MAGIC))
    if magic == PARQUET_MAGIC or path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow's ArrowInvalid/OSError, reported in one line
            raise UserError(f"{name}: not a readable Parquet file: {_one_line(exc)}") from exc
        return Source(path, name, "parquet", tuple(schema.names))
    return Source(path, name, "jsonl")


def data_sha256(path: str | Path) -> str:
    """sha256 of a data file's bytes; of a dataset directory, of each file's relative path and
    sha256, in path order."""
    from ouro_cli.artifacts import sha256_file

    path = Path(path)
    if not path.is_dir():
        return sha256_file(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path).as_posix()}\t{sha256_file(file)}\n".encode())
    return digest.hexdigest()


# ---- JSONL ---------------------------------------------------------------------------


def _jsonl_records(path: Path, name: str) -> Iterator[tuple[int, Any]]:
    for line_no, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # UTF-8 byte-order mark
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield line_no, BadRecord(f"not UTF-8 (byte {exc.start + 1})")
            continue
        if not text.strip():
            continue
        try:
            yield line_no, json.loads(text)
        except json.JSONDecodeError as exc:
            yield line_no, BadRecord(f"bad JSON: {exc.msg} (column {exc.colno})")


# ---- Parquet and datasets directories ------------------------------------------------


def _columns_for(available: Iterable[str], keys: Iterable[str]) -> list[str]:
    available = list(available)
    wanted = []
    for key in keys:
        column = key if key in available else key.split(".", 1)[0]
        if column in available and column not in wanted:
            wanted.append(column)
    return wanted


def _parquet_records(path: Path, name: str, columns: list[str]) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    number = 0
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, columns=columns)
        for batch in batches:
            for row in batch.to_pylist():
                number += 1
                yield number, row
    except Exception as exc:  # noqa: BLE001 - a damaged file, found part way through
        raise UserError(f"{name}:{number + 1}: cannot read the Parquet file past here: {_one_line(exc)}") from exc


def _open_dataset_dir(path: Path, name: str) -> Source:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        if len(splits) != 1:
            raise UserError(
                f"{name} holds the splits {', '.join(splits)}; pass one of them, e.g. "
                f"{Path(name) / (splits[0] if splits else 'train')}"
            )
    elif not (path / "state.json").is_file():
        raise UserError(
            f"{name} is a directory, not a data file; give a .jsonl or .parquet file, or a "
            "directory written by datasets' save_to_disk (it holds state.json)"
        )
    return Source(path, name, "datasets", tuple(_load_dataset_dir(path, name).column_names))


def _load_dataset_dir(path: Path, name: str):
    """The `datasets.Dataset` saved at `path` (a DatasetDict of one split: that split)."""
    try:
        import datasets
    except ImportError as exc:
        raise UserError(
            f"{name} is a datasets directory (save_to_disk); reading it needs the datasets library: {HF_HINT}"
        ) from exc
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - datasets' own errors, reported in one line
        raise UserError(f"{name}: datasets cannot load it: {_one_line(exc)}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        (loaded,) = loaded.values()  # _open_dataset_dir refused several splits
    return loaded


def _dataset_records(path: Path, name: str, columns: list[str]) -> Iterator[tuple[int, Any]]:
    dataset = _load_dataset_dir(path, name).select_columns(columns)
    number = 0
    # arrow batches, converted as Parquet's are, so a dataset and the Parquet file it came from
    # give the same rows (datasets' Python format returns a Sequence of structs as a struct of lists)
    for table in dataset.with_format("arrow").iter(batch_size=BATCH_ROWS):
        for row in table.to_pylist():
            number += 1
            yield number, row


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


__all__ = ["BadRecord", "HF_HINT", "Source", "data_sha256", "open_source"]
