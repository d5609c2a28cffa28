"""Kill-test harness: runs stopped by SIGKILL, SIGTERM and SIGINT at chosen points, then
resumed, end bit for bit where an uninterrupted run ends.

A fault point (ouro_cli/testing/faults.py, OURO_TEST_FAULT) makes the process signal
itself at an exact place: inside a save (`save.staged`: every file written, nothing
committed), during a first save (`save.renamed`: the iteration complete, no tracker yet),
right after the tracker moves (`save.tracker`), during the rollout (`rollout`). Each
chain interrupts one run directory again and again; after every interruption the test
checks the exit code, the one line and what is on disk, and the last `ouro resume`
reaches N updates. The result is then compared with the uninterrupted run by what
verify-resume compares (rollouts, per-update state hashes, checkpoint tensors, trainer
state, data cursor), and its metrics lines are 0..N-1, each exactly once, equal to the
uninterrupted run's but for timings.

The two chains run side by side (each step is a fresh process that pays seconds of
imports), next to the reference run.
"""

from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ouro_cli.rl.lock import read_lock

from .harness import error_line, metrics_updates, run, tracker
from .tiny_checkpoint import REWARD, make_checkpoint

pytestmark = pytest.mark.slow

N = 4  # updates; checkpoints at 2 and 4


def train_args(root: Path) -> list[str]:
    return [
        "--model",
        root / "hf",
        "--data",
        root / "train.jsonl",
        "--eval-data",
        root / "eval.jsonl",
        "--depths",
        "2",
        "3",
        "4",
        "--prompts-per-update",
        "2",
        "--group-size",
        "3",
        "--max-response-len",
        "6",
        "--eval-prompts",
        "2",
        "--eval-depths",
        "4",
        "--max-num-seqs",
        "4",
        "--exit-threshold",
        "0.9",
        "--reward-function",
        REWARD,
        "--updates",
        N,
        "--save-interval",
        "2",
        "--state-digest",
    ]


@dataclass
class Step:
    """One process of a chain, and what it must leave behind."""

    args: list[object]
    fault: str | None
    code: int
    line: str | None = None  # regex the one error line must match (None: exit 0)
    rows: list[int] = field(default_factory=list)
    tracker: str | None = None
    complete: bool = False
    notes: tuple[str, ...] = ()  # what the command must say on stderr


def run_chain(root: Path, steps: list[Step]) -> None:
    run_dir = root / "run"
    for i, step in enumerate(steps):
        args = [a.format(run=run_dir) if isinstance(a, str) else a for a in step.args]
        proc = run(*args, cwd=root, fault=step.fault)
        where = f"step {i} ({step.fault}): {proc.stderr[-3000:]}"
        assert proc.returncode == step.code, where
        if step.line is not None:
            assert re.search(step.line, error_line(proc)), where
        if step.code < 0:  # SIGKILL: not a word, and nothing after the fault point
            assert "error:" not in proc.stderr, where
        assert "FutureWarning" not in proc.stderr and "Traceback" not in proc.stderr, where
        for note in step.notes:
            assert note in proc.stderr, where
        assert metrics_updates(run_dir) == step.rows, where
        assert tracker(run_dir) == step.tracker, where
        assert (run_dir / "COMPLETE").is_file() is step.complete, where
        assert read_lock(run_dir) is None, where  # a dead or finished holder holds nothing


KILLED = -signal.SIGKILL
RESUME = ["resume", "{run}", "--updates", N]


def sigkill_chain(root: Path) -> list[Step]:
    train = ["train", *train_args(root), "--run-dir", "{run}"]
    return [
        # during the first save: iter_2 is whole, the tracker was never written
        Step(train, "save.renamed@1=KILL", KILLED, rows=[0, 1]),
        # inside the save at 4 (files written, nothing committed); the resume repaired the tracker first
        Step(RESUME, "save.staged@1=KILL", KILLED, rows=[0, 1, 2, 3], tracker="2", notes=("tracker now does",)),
        # during update 2's rollout: the resume dropped updates 2-3, which ran after the checkpoint
        Step(
            RESUME,
            "rollout@1=KILL",
            KILLED,
            rows=[0, 1],
            tracker="2",
            notes=("2 update(s) after the checkpoint at 2 will run again",),
        ),
        # right after the final save's tracker moved: every update saved and logged, no COMPLETE
        Step(RESUME, "save.tracker@1=KILL", KILLED, rows=[0, 1, 2, 3], tracker="4"),
        # the resume of a run that has its updates runs its end stage only
        Step(RESUME, None, 0, rows=[0, 1, 2, 3], tracker="4", complete=True),
    ]


def signal_chain(root: Path) -> list[Step]:
    train = ["train", *train_args(root), "--run-dir", "{run}"]
    return [
        # killed before any checkpoint
        Step(train, "rollout@2=KILL", KILLED, rows=[0]),
        # `train` starts such a run again without --overwrite; SIGTERM after update 0, told not to save
        Step(
            [*train, "--save-on-interrupt", "off"],
            "rollout@1=TERM",
            143,
            line=r"^error: stopped by SIGTERM after update 0 \(no checkpoint yet: the resume starts it again\); "
            rf"continue with: ouro resume .*run --updates {N}$",
            rows=[0],
            notes=("never saved a checkpoint: starting it again",),
        ),
        # the resume of a run without a checkpoint starts it again; SIGINT inside the first save:
        # the save completes, then the run stops
        Step(
            [*RESUME, "--save-on-interrupt", "auto"],
            "save.staged@1=INT",
            130,
            line=r"^error: stopped by SIGINT after update 1 \(its checkpoint is at update 2\); "
            rf"continue with: ouro resume .*run --updates {N}$",
            rows=[0, 1],
            tracker="2",
            notes=("starting it again from update 0",),
        ),
        # two SIGINTs during update 2's rollout: the second stops at once
        Step(
            RESUME,
            "rollout@1=INT+INT",
            130,
            line=r"^error: stopped at once by a second SIGINT: .*ouro resume",
            rows=[0, 1],
            tracker="2",
        ),
        # SIGTERM during update 2: it finishes, and the save due at 4 is near, so the stop saves at 3
        Step(
            RESUME,
            "rollout@1=TERM",
            143,
            line=r"^error: stopped by SIGTERM after update 2 \(checkpoint saved at update 3\)",
            rows=[0, 1, 2],
            tracker="3",
        ),
        Step(RESUME, None, 0, rows=[0, 1, 2, 3], tracker="4", complete=True),
    ]


TIMINGS = re.compile(r"(_s|_ms|_us|_hours)$")  # wall times (the engine's counters of them included)


def deterministic(row: dict) -> dict:
    """A metrics line without its timings (wall-clock seconds differ from run to run)."""
    return {k: v for k, v in row.items() if not TIMINGS.search(k) and k not in ("rank_rollout_s", "rank_train_s")}


def test_interrupted_runs_resume_to_the_uninterrupted_result(tmp_path):
    from ouro_cli.checks.verify_resume import compare_runs

    roots = {name: tmp_path / name for name in ("reference", "sigkill", "signals")}
    for root in roots.values():
        root.mkdir()
        make_checkpoint(root)  # the same seed: the same model and data in each root
    with ThreadPoolExecutor(3) as pool:
        reference = pool.submit(
            run,
            "train",
            *train_args(roots["reference"]),
            "--run-dir",
            roots["reference"] / "run",
            cwd=roots["reference"],
        )
        chains = [
            pool.submit(run_chain, roots["sigkill"], sigkill_chain(roots["sigkill"])),
            pool.submit(run_chain, roots["signals"], signal_chain(roots["signals"])),
        ]
        proc = reference.result()
        assert proc.returncode == 0, proc.stderr
        for chain in chains:
            chain.result()

    expected = [
        deterministic(json.loads(x)) for x in (roots["reference"] / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    for name in ("sigkill", "signals"):
        run_dir = roots[name] / "run"
        report = compare_runs(roots["reference"] / "run", run_dir)
        assert report.identical, (name, report.first_divergence)
        names = {c.name: c.compared for c in report.categories}
        assert names["rollouts"] == N * 6 and names["state hashes"] == N
        rows = [deterministic(json.loads(x)) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["update"] for r in rows] == list(range(N))
        for got, want in zip(rows, expected, strict=True):
            assert got == want, (name, got["update"], {k for k in want if got.get(k) != want[k]})
