"""Compare two runs bit for bit: the proof behind `ouro verify-resume`.

Categories, each compared exactly:
- checkpoint tensors: every tensor of the final Megatron checkpoints (model, fp32 main
  weights, both Adam moments) by dtype, shape and sha256 of its bytes (`checkpoint_digest`;
  a run whose checkpoint was dropped to free disk keeps its digest, `drop_checkpoint`);
- trainer state: scheduler state, Adam step counts, iteration, data cursor;
- rollouts: per update and sample, the whole record (token ids, exit depths, logprobs
  as exact float hex, rewards, seeds, versions);
- state hashes: the per-update sha256 of model + optimizer state (`--state-digest`).
The first divergence is reported as (category, update, sample, tensor or field) with
the max |Δ| where tensors differ.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ouro_cli.checkpoint import layout
from ouro_cli.errors import UserError
from ouro_cli.rl.metrics import read_jsonl
from ouro_cli.rl.run_dir import RunDir


@dataclass
class Category:
    name: str
    compared: int = 0
    differing: int = 0
    first: dict[str, Any] | None = None

    def record(self, equal: bool, **where: Any) -> None:
        self.compared += 1
        if not equal:
            self.differing += 1
            if self.first is None:
                self.first = where

    @property
    def ok(self) -> bool:
        return self.compared > 0 and self.differing == 0


@dataclass
class Report:
    run_a: str
    run_b: str
    categories: list[Category] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return all(c.ok for c in self.categories)

    @property
    def first_divergence(self) -> dict[str, Any] | None:
        for c in self.categories:
            if c.first is not None:
                return {"category": c.name, **c.first}
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"run_a": self.run_a, "run_b": self.run_b, "identical": self.identical,
                "first_divergence": self.first_divergence,
                "categories": [{"name": c.name, "compared": c.compared, "differing": c.differing,
                                "ok": c.ok, "first": c.first} for c in self.categories]}


def _sha(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


DIGEST_FILE = "checkpoint_digest.json"


def checkpoint_tensors(run: RunDir) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of the run's latest checkpoint (model under its HF names, and the optimizer's
    `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<name>`), and its trainer_state.json."""
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    from ouro_cli.mcore import megatron_on_cpu, single_process_group

    it = layout.latest_iteration_dir(run.checkpoint)
    with single_process_group(), megatron_on_cpu():
        tensors = load_plain_tensors(str(it))
    state = json.loads((it / "trainer_state.json").read_text())
    return {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}, state


def checkpoint_digest(run: RunDir) -> dict[str, Any]:
    """What the comparison needs of a run's final checkpoint: each tensor's dtype, shape and
    sha256, and the trainer state; read from `DIGEST_FILE` where `drop_checkpoint` left one."""
    saved = run.root / DIGEST_FILE
    if saved.is_file() and not run.checkpoint.exists():
        return json.loads(saved.read_text())
    tensors, state = checkpoint_tensors(run)
    return {"tensors": {name: [str(t.dtype), list(t.shape), _sha(t)] for name, t in tensors.items()},
            "trainer_state": state}


def drop_checkpoint(run: RunDir) -> None:
    """Keep the digest of the run's final checkpoint and delete the checkpoint (at 1.4B with Adam
    it is 19 GB, and verify-resume's other run needs the disk)."""
    import shutil

    from ouro_cli.artifacts import write_json_atomic

    write_json_atomic(run.root / DIGEST_FILE, checkpoint_digest(run))
    shutil.rmtree(run.checkpoint)


def compare_checkpoints(a: RunDir, b: RunDir, report: Report) -> None:
    digest_a, digest_b = checkpoint_digest(a), checkpoint_digest(b)
    tensors_a, tensors_b = digest_a["tensors"], digest_b["tensors"]
    both_present = a.checkpoint.exists() and b.checkpoint.exists()
    full = (checkpoint_tensors(a)[0], checkpoint_tensors(b)[0]) if both_present and tensors_a != tensors_b else None
    cat = Category("checkpoint tensors")
    for name in sorted(set(tensors_a) | set(tensors_b)):
        ta, tb = tensors_a.get(name), tensors_b.get(name)
        if ta is None or tb is None:
            cat.record(False, tensor=name, reason="missing in " + ("run A" if ta is None else "run B"))
            continue
        where: dict[str, Any] = {"tensor": name}
        if ta != tb and full is not None and ta[:2] == tb[:2] and full[0][name].is_floating_point():
            where["max_abs_diff"] = float((full[0][name].double() - full[1][name].double()).abs().max())
        cat.record(ta == tb, **where)
    report.categories.append(cat)
    state_a, state_b = digest_a["trainer_state"], digest_b["trainer_state"]
    state = Category("trainer state")
    for key in sorted(set(state_a) | set(state_b)):
        state.record(state_a.get(key) == state_b.get(key), field=key, a=state_a.get(key), b=state_b.get(key))
    report.categories.append(state)


def compare_rollouts(a: RunDir, b: RunDir, report: Report) -> None:
    cat = Category("rollouts")
    files_a = sorted(p.name for p in a.rollouts.glob("update_*.jsonl"))
    files_b = sorted(p.name for p in b.rollouts.glob("update_*.jsonl"))
    if files_a != files_b:
        cat.record(False, reason=f"run A has {len(files_a)} rollout files, run B {len(files_b)}")
    for name in files_a:
        update = int(name[len("update_"):-len(".jsonl")])
        ra, rb = read_jsonl(a.rollouts / name), read_jsonl(b.rollouts / name)
        if len(ra) != len(rb):
            cat.record(False, update=update, reason=f"{len(ra)} vs {len(rb)} samples")
            continue
        for i, (x, y) in enumerate(zip(ra, rb, strict=True)):
            differing = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            where: dict[str, Any] = {"update": update, "sample": i}
            if differing:
                where["field"] = differing[0]
                if differing[0] == "logprobs":
                    la = [float.fromhex(v) for v in x["logprobs"]]
                    lb = [float.fromhex(v) for v in y["logprobs"]]
                    where["max_abs_diff"] = max((abs(p - q) for p, q in zip(la, lb, strict=False)), default=None)
            cat.record(not differing, **where)
    report.categories.append(cat)


def compare_state_hashes(a: RunDir, b: RunDir, report: Report) -> None:
    cat = Category("state hashes")
    ma = {m["update"]: m.get("state_sha256") for m in read_jsonl(a.metrics)}
    mb = {m["update"]: m.get("state_sha256") for m in read_jsonl(b.metrics)}
    for update in sorted(set(ma) | set(mb)):
        ha, hb = ma.get(update), mb.get(update)
        if ha is None and hb is None:
            continue
        cat.record(ha == hb, update=update, a=ha, b=hb)
    if cat.compared:
        report.categories.append(cat)


def compare_runs(run_a: Path, run_b: Path) -> Report:
    a, b = RunDir(run_a), RunDir(run_b)
    for run in (a, b):
        if not run.is_run():
            raise UserError(f"{run.root} is not an ouro run directory (no {run.plan.name})")
    report = Report(str(run_a), str(run_b))
    # chronological: what diverges first in a run is reported first
    compare_rollouts(a, b, report)
    compare_state_hashes(a, b, report)
    compare_checkpoints(a, b, report)
    cursor = Category("data cursor")
    pa, pb = json.loads(a.plan.read_text()), json.loads(b.plan.read_text())
    cursor.record(pa["cursor"] == pb["cursor"] and pa["next_update"] == pb["next_update"],
                  a={"cursor": pa["cursor"], "next_update": pa["next_update"]},
                  b={"cursor": pb["cursor"], "next_update": pb["next_update"]})
    report.categories.append(cursor)
    return report
