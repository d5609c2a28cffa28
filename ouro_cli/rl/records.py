"""An update's records, and how a resume reconciles them with the checkpoint it continues.

Commit order (the invariant a resume relies on): update u's rollouts file, then its
metrics line, are written — and, when a save follows, flushed to disk — before the save
that includes update u starts. So whatever moment a process dies at, every update below
the latest checkpoint has its records, and records above it belong to updates that the
resume runs again (identically: the checkpoint holds the data cursor and every RNG).

`resume_point` reads (and writes nothing) where a run stands before anything heavy runs:
the checkpoint's next update (from the latest complete iteration; None without one),
refusing what cannot continue: a damaged trainer state, a gap in the records below the
checkpoint, a run that already has its updates. Once the resume is under way, rank 0
calls `repair_tracker` and `drop_after`, which forgets the records above the checkpoint
(metrics lines, interval evaluations, rollouts files), so that every update is logged
exactly once.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ouro_cli.artifacts import is_complete
from ouro_cli.errors import UserError

from .metrics import append_jsonl, read_jsonl
from .run_dir import RunDir

STATE_FILE = "trainer_state.json"  # written by trainer/checkpointing.py into every iteration


def write_update(
    run: RunDir, update: int, rollouts: list[dict[str, Any]], row: dict[str, Any], *, durable: bool
) -> None:
    """Rollouts file first, metrics line last (the line is what says the update is logged);
    `durable` flushes both to disk (before a save that includes the update)."""
    run.rollouts.mkdir(exist_ok=True)
    run.rollout_file(update).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rollouts))
    append_jsonl(run.metrics, row)
    if durable:
        sync_update(run, update)


def sync_update(run: RunDir, update: int) -> None:
    """Flush update `update`'s records to disk (before a save that includes it)."""
    for path in (run.rollout_file(update), run.metrics):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())


def checkpoint_next_update(run: RunDir) -> int | None:
    """`next_update` of the run's latest complete checkpoint; None when no save ever committed."""
    from ouro_cli.checkpoint import layout

    if not run.has_checkpoint():
        return None
    return read_trainer_state(layout.latest_iteration_dir(run.checkpoint))["next_update"]


def read_trainer_state(iteration_dir: Path) -> dict[str, Any]:
    """The `extra` of an iteration's trainer_state.json (its `next_update` an int), or a
    UserError naming the file and saying what to do."""
    state_file = Path(iteration_dir) / STATE_FILE
    try:
        extra = json.loads(state_file.read_text())["extra"]
        return {**extra, "next_update": int(extra["next_update"])}
    except FileNotFoundError:
        raise UserError(
            f"{state_file} is missing: {state_file.parent.name} holds no training state; remove "
            f"{state_file.parent} to resume from the iteration before it (from the start when there "
            "is none)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
        raise UserError(
            f"{state_file} is damaged ({type(err).__name__}: {err}); remove "
            f"{state_file.parent} to resume from the iteration before it (from the start when there "
            "is none)"
        ) from None


def resume_point(run: RunDir, updates: int, log: Callable[[str], None] = lambda s: None) -> int | None:
    """The update a resume continues at (None: no checkpoint yet, the run starts again),
    after checking that the records below it are whole."""
    start = checkpoint_next_update(run)
    if start is None:
        return None
    if start > updates or (start == updates and is_complete(run.root)):
        raise UserError(f"the run already has {start} updates; ask for more with --updates")
    check_records(run, start, log)
    return start


def repair_tracker(run: RunDir, log: Callable[[str], None] = lambda s: None) -> None:
    """Point the tracker at the latest complete iteration (checkpoint/layout.py), saying why."""
    from ouro_cli.checkpoint import layout

    named = layout.read_tracker(run.checkpoint) if (run.checkpoint / layout.TRACKER).is_file() else None
    repaired = layout.repair_tracker(run.checkpoint)
    if repaired is None:
        return
    name = layout.iteration_dir_name(repaired)
    if named is not None and named != layout.RELEASE and repaired != layout.RELEASE and named > repaired:
        log(
            f"checkpoint: the tracker named {layout.iteration_dir_name(named)}, which is gone or incomplete; it now "
            f"names {name}, the newest complete iteration"
        )
    else:
        log(
            f"checkpoint: {name} is complete but its save was interrupted before the tracker named it; the "
            "tracker now does"
        )


def check_records(run: RunDir, start: int, log: Callable[[str], None] = lambda s: None) -> None:
    """Every update below the checkpoint must be logged exactly once, with its rollouts file."""
    counts = Counter(r.get("update") for r in read_jsonl(run.metrics, log))
    missing = [u for u in range(start) if counts[u] == 0]
    repeated = [u for u in range(start) if counts[u] > 1]
    absent = [u for u in range(start) if counts[u] and not run.rollout_file(u).is_file()]
    for what, found in (
        (f"{run.metrics.name} has no line for", missing),
        (f"{run.metrics.name} logs more than once", repeated),
        (f"{run.rollouts.name}/ has no file for", absent),
    ):
        if found:
            shown = ", ".join(map(str, found[:5])) + (", ..." if len(found) > 5 else "")
            raise UserError(
                f"{run.root}: the checkpoint at update {start} includes update(s) {shown}, but {what} "
                "them; resuming would leave the records with a gap. Restore the records from a copy "
                "of the run, or start over with `ouro train --overwrite`"
            )


def drop_after(run: RunDir, start: int, *, finishing: bool, log: Callable[[str], None] = lambda s: None) -> None:
    """Forget what ran after the checkpoint at `start` (it runs again): metrics lines, interval
    evaluations (and their responses) and rollouts files of updates >= start. `finishing`
    (the run has all its updates and only its end stage is missing) also drops a partial end
    evaluation."""
    rows = read_jsonl(run.metrics, log)
    kept = [r for r in rows if r["update"] < start]
    _rewrite(run.metrics, kept)
    if len(rows) > len(kept):
        log(f"resume: {len(rows) - len(kept)} update(s) after the checkpoint at {start} will run again")
    _rewrite(run.evaluations, [e for e in read_jsonl(run.evaluations, log) if _kept(e, start, finishing)])
    _rewrite(run.responses, [e for e in read_jsonl(run.responses, log) if _kept(e, start, finishing)])
    for path in run.rollouts.glob("update_*.jsonl"):
        if int(path.stem[len("update_") :]) >= start:
            path.unlink()


def _kept(evaluation: dict[str, Any], start: int, finishing: bool) -> bool:
    """Evaluations at `start` ran before its checkpoint (interval) or at the end of an earlier,
    shorter run (end); a start evaluation at 0, or a partial end one, runs again."""
    update, when = evaluation["update"], evaluation["when"]
    return update < start or (update == start and (when == "interval" or (when == "end" and not finishing)))


def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a JSONL log by `rows`, atomically (a kill leaves the old file or the new one)."""
    if not path.is_file() and not rows:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("")
    for r in rows:
        append_jsonl(tmp, r)
    os.replace(tmp, path)
