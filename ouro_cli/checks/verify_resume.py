"""`ouro verify-resume`'s back-end: run a job continuously and with a fresh-process resume
(`verify`), and compare two runs bit for bit (`compare_runs`).

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
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ouro_cli.checkpoint import layout
from ouro_cli.errors import ResourceError, UserError
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
    path: str | None = None  # where report.json was written

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
        return {
            "run_a": self.run_a,
            "run_b": self.run_b,
            "identical": self.identical,
            "first_divergence": self.first_divergence,
            "categories": [
                {"name": c.name, "compared": c.compared, "differing": c.differing, "ok": c.ok, "first": c.first}
                for c in self.categories
            ],
        }


def _sha(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


DIGEST_FILE = "checkpoint_digest.json"


def checkpoint_tensors(run: RunDir) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of the run's latest checkpoint (model under its HF names, and the optimizer's
    `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<name>`), and its trainer_state.json."""
    from ouro_cli.checkpoint.megatron import read_dist_tensors

    it = layout.latest_iteration_dir(run.checkpoint)
    tensors = read_dist_tensors(it)
    state = json.loads((it / "trainer_state.json").read_text())
    return tensors, state


def checkpoint_digest(run: RunDir) -> dict[str, Any]:
    """What the comparison needs of a run's final checkpoint: each tensor's dtype, shape and
    sha256, and the trainer state; read from `DIGEST_FILE` where `drop_checkpoint` left one."""
    saved = run.root / DIGEST_FILE
    if saved.is_file() and not run.checkpoint.exists():
        return json.loads(saved.read_text())
    tensors, state = checkpoint_tensors(run)
    return {
        "tensors": {name: [str(t.dtype), list(t.shape), _sha(t)] for name, t in tensors.items()},
        "trainer_state": state,
    }


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
        update = int(name[len("update_") : -len(".jsonl")])
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
    cursor.record(
        pa["cursor"] == pb["cursor"] and pa["next_update"] == pb["next_update"],
        a={"cursor": pa["cursor"], "next_update": pa["next_update"]},
        b={"cursor": pb["cursor"], "next_update": pb["next_update"]},
    )
    report.categories.append(cursor)
    return report


# ---- the verify-resume job ------------------------------------------------------------

REFERENCE, RESUMED, REPORT, MARKER, LOGS = "reference", "resumed", "report.json", "verify-resume.json", "logs"


def verify(
    train_args: list[str],
    *,
    model: str,
    inputs: list[Path],
    updates: int,
    resume_at: int,
    work: Path,
    log: Callable[[str], None] = lambda s: None,
) -> Report:
    """`ouro verify-resume`: the reference and the resumed run in `work`, compared; report.json beside them.

    W must be empty or one of verify-resume's own earlier work directories (its marker
    `verify-resume.json` or a `report.json`, and nothing but the two runs besides), and must
    lie outside `inputs` (the train options' model and data), so that the runs' `--overwrite`
    can only replace earlier runs of verify-resume. W is locked (ouro_cli.rl.lock) while this
    works in it.

    Disk: before anything runs, W's filesystem must hold two checkpoints of the model (the
    size follows from its parameter count: bf16 weights, fp32 main weights and both Adam
    moments at most), which is what the runs hold at once: the reference run's checkpoint is
    replaced by its digest once it is complete (`drop_checkpoint`), and both runs keep one
    iteration (`--keep-last 1` unless given), the resumed run holding its M-th while it
    writes its N-th. At Ouro-1.4B that is 40 GB."""
    from ouro_cli.artifacts import write_json_atomic
    from ouro_cli.rl.lock import RunLock
    from ouro_cli.warnings_log import attach_active

    check_work_dir(work, inputs)
    check_disk(work, model)
    with RunLock(work, "ouro verify-resume", log=log):
        write_json_atomic(work / MARKER, {"updates": updates, "resume_at": resume_at, "train_args": train_args})
        attach_active(work / LOGS / "warnings.log")
        run_pair(train_args, updates, resume_at, work / REFERENCE, work / RESUMED, log)
        return compare_and_write(work / REFERENCE, work / RESUMED, work / REPORT)


def compare_held(run_a: Path, run_b: Path) -> Report:
    """`ouro verify-resume --compare`: two existing runs, each locked while read; report.json beside RUN_A."""
    import contextlib

    from ouro_cli.rl.lock import RunLock

    with contextlib.ExitStack() as held:
        for run in dict.fromkeys((run_a.resolve(), run_b.resolve())):
            held.enter_context(RunLock(run, "ouro verify-resume --compare", create=False))
        return compare_and_write(run_a, run_b, run_a.parent / REPORT)


def compare_and_write(run_a: Path, run_b: Path, path: Path) -> Report:
    from ouro_cli.artifacts import write_json_atomic

    report = compare_runs(run_a, run_b)
    report.path = str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, report.to_dict())
    return report


CHECKPOINT_BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weights, fp32 main weights, Adam's two moments
DISK_MARGIN = 1.05


def check_disk(work: Path, model: str) -> None:
    """W's filesystem must hold the two checkpoints the runs hold at once (`verify`);
    earlier runs in W, which the new ones replace, count as free."""
    import shutil

    from ouro_cli.checkpoint import open_checkpoint
    from ouro_cli.rl.sizing import GIB, parameter_counts

    total, _ = parameter_counts(open_checkpoint(Path(model)).config)
    need = int(2 * total * CHECKPOINT_BYTES_PER_PARAM * DISK_MARGIN)
    where = work if work.exists() else next(p for p in work.absolute().parents if p.exists())
    earlier = sum(f.stat().st_size for run in (REFERENCE, RESUMED) for f in (work / run).rglob("*") if f.is_file())
    free = shutil.disk_usage(where).free + earlier
    if free < need:
        raise ResourceError(
            f"verify-resume needs about {need / GIB:.1f} GiB of disk for its two runs' checkpoints "
            f"(two of {total * CHECKPOINT_BYTES_PER_PARAM / GIB:.1f} GiB), {where} has "
            f"{free / GIB:.1f} GiB free; choose a --work-dir on a larger disk"
        )


def check_work_dir(work: Path, inputs: list[Path]) -> None:
    """The output guard (ouro_cli/outputs.py) for W, whose own rule for what W may hold is: nothing,
    or an earlier work dir of verify-resume."""
    from ouro_cli.outputs import check_output
    from ouro_cli.rl.lock import LOCK_FILE

    check_output(work, overwrite=True, inputs=inputs, what="work directory")
    if not work.is_dir():
        return
    names = {p.name for p in work.iterdir()} - {LOCK_FILE}
    ours = {REFERENCE, RESUMED, REPORT, MARKER, LOGS}
    if names and (not names & {REPORT, MARKER} or names - ours):
        other = sorted(names - ours) or sorted(names)
        raise UserError(
            f"work directory {work} is not empty ({other[0]}) and is not an earlier verify-resume work "
            f"directory (those hold only {', '.join(sorted(ours))}); choose an empty one"
        )


def _ouro(args: list[str], what: str, log: Callable[[str], None]) -> None:
    log(f"$ ouro {' '.join(args)}")
    proc = subprocess.run(
        [sys.executable, "-m", "ouro_cli.cli.app", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"the {what} failed (exit {proc.returncode}): {tail[0]}")


def run_pair(
    train_args: list[str], updates: int, resume_at: int, run_a: Path, run_b: Path, log: Callable[[str], None]
) -> None:
    """The reference run (N updates) and the resumed one (M, then a fresh-process resume to N),
    each an `ouro train`/`ouro resume` subprocess given `train_args`."""
    keep = [] if "--keep-last" in train_args else ["--keep-last", "1"]  # one iteration each: the disk check
    # the first leg stops at M but plans the reference's schedule (a cosine decays over N)
    horizon = [] if "--lr-decay-updates" in train_args else ["--lr-decay-updates", str(updates)]
    common = [*train_args, *keep, *horizon, "--state-digest", "--overwrite"]
    _ouro(["train", *common, "--updates", str(updates), "--run-dir", str(run_a)], "reference run", log)
    drop_checkpoint(RunDir(run_a))  # its digest is all the comparison needs
    _ouro(["train", *common, "--updates", str(resume_at), "--run-dir", str(run_b)], f"first {resume_at} updates", log)
    _ouro(["resume", str(run_b), "--updates", str(updates)], "resume", log)
