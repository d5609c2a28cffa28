"""Per-update metrics: one JSON line each in metrics.jsonl, and the end-of-run plot.

Device-hours count each distinct device once: a trainer and an engine sharing one GPU
(or the CPU) bill one device for the job's wall time.

An update's line is written before the checkpoint save that follows it (records.py), so
it cannot hold that save's duration: `save_s` is the save that ran between the previous
line and this update (0.0 when none), and `step_s` includes it, so the lines' `step_s`
add up to the run's wall time after setup. The last save's figures (`save_s`, its peak
memory, allocation retries: a line's save fields) are the run summary's `final_save` and
are kept in the run's COMPLETE marker.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ouro_cli.errors import UserError


def rollout_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Summary of an update's rollout records (`RolloutSample.record`, gathered over ranks)."""
    rewards = [r["reward"] for r in records]
    decode_depths = [d for r in records for d in r["exit_depths"][1:]]
    histogram = Counter(decode_depths)
    return {
        "reward_mean": sum(rewards) / len(rewards),
        "rewards": rewards,
        "response_lengths": [len(r["response_ids"]) for r in records],
        "truncations": sum(r["finish_reason"] == "length" for r in records),
        "exit_depth_histogram": {str(k): histogram[k] for k in sorted(histogram)},
        "mean_exit_depth": sum(decode_depths) / len(decode_depths) if decode_depths else None,
    }


def tenths(batches: Sequence[int]) -> list[float]:
    """The decode batch over time: the mean rows of each tenth of the steps `batches` lists
    (fewer parts when there are fewer than ten steps), to one decimal."""
    n, parts = len(batches), min(10, len(batches))
    edges = [round(i * n / parts) for i in range(parts + 1)] if parts else []
    return [round(sum(batches[a:b]) / (b - a), 1) for a, b in itertools.pairwise(edges)]


def counter_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: int(v) - int(before.get(k, 0)) for k, v in after.items() if isinstance(v, int)}


def device_hours(seconds: float, devices: Iterable[str]) -> float:
    return seconds * len(set(devices)) / 3600.0


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True, default=_json_default) + "\n")
        f.flush()


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """`records` as a new JSONL file, one line each as `append_jsonl` writes them."""
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record, sort_keys=True, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def read_jsonl(path: Path, log: Callable[[str], None] = lambda s: None) -> list[dict[str, Any]]:
    """The lines of a JSONL log (none when the file does not exist). A last line cut short by a
    killed writer is dropped (said in `log`); any other line that does not parse is a UserError
    naming the file and the line."""
    if not Path(path).is_file():
        return []
    lines = [x for x in Path(path).read_text().splitlines() if x.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                log(f"{path}: dropped a last line cut short by an interrupted write")
                break
            raise UserError(
                f"{path}:{i + 1} is not valid JSON ({err.msg}); the file is damaged: repair or remove that line"
            ) from None
    return rows
