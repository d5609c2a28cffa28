"""Where a run stands, read from its files alone (`ouro status RUN`): nothing is written.

Updates done of the total (the metrics lines; the plan's `next_update` is what the latest
checkpoint continues from), the last training reward per K, the latest held-out accuracy
per K, the latest complete checkpoint, the plan's contract hash, whether a process holds
the run's lock (it is still being written) and whether the run is complete. A record
cut short by a killed writer is left out, as `resume` leaves it (`notes` says so); a
file that cannot be read otherwise is named in the error or in the checkpoint's `problem`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ouro_cli.artifacts import is_complete
from ouro_cli.errors import UserError

from .lock import read_lock
from .metrics import read_jsonl
from .records import read_trainer_state
from .run_dir import RunDir


def run_status(root: Path) -> dict[str, Any]:
    run = RunDir(root)
    if not run.is_run():
        raise UserError(f"{run.root} is not an ouro run directory (no {run.plan.name})")
    from . import plan as plans

    plan = plans.read_plan(run.plan)
    notes: list[str] = []
    rows, evaluations = read_jsonl(run.metrics, notes.append), read_jsonl(run.evaluations, notes.append)
    last_reward: dict[int, dict[str, Any]] = {}
    for r in rows:
        last_reward[int(r["k"])] = {"update": r["update"], "reward_mean": r["reward_mean"]}
    accuracy: dict[int, dict[str, Any]] = {}
    for e in evaluations:
        accuracy[int(e["k"])] = {"update": e["update"], "when": e.get("when"), "accuracy": e["accuracy"]}
    holder = read_lock(run.root)
    return {
        "run_dir": str(run.root),
        "updates_done": len(rows),
        "updates_total": plan["options"]["updates"],
        "checkpoint": _latest_checkpoint(run),
        "next_update": plan["next_update"],
        "plan_sha256": plans.contract_hash(plan["contract"]),
        "last_reward_per_k": {str(k): v for k, v in sorted(last_reward.items())},
        "accuracy_per_k": {str(k): v for k, v in sorted(accuracy.items())},
        "running": holder is not None,
        "holder": holder.describe() if holder is not None else None,
        "complete": is_complete(run.root),
        "notes": notes,
    }


def _latest_checkpoint(run: RunDir) -> dict[str, Any] | None:
    """The latest complete iteration (its directory and next update), None before the first save."""
    from ouro_cli.checkpoint import layout

    if not run.has_checkpoint():
        return None
    try:
        it = layout.latest_iteration_dir(run.checkpoint)
        return {"path": str(it), "next_update": read_trainer_state(it)["next_update"]}
    except UserError as err:
        return {"problem": str(err)}
