"""`ouro status` on a run that is being written and on a finished one, and `ouro plot`.

The running case is made exact with the test-only fault point (ouro_cli/testing/faults.py):
the run stops itself (SIGSTOP) after its second rollout, status reads it while it holds
its lock, and SIGCONT lets it finish.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from .harness import env_for
from .test_train_cli import ouro

# two samples per held-out prompt: status and plot read accuracy, which is then avg@2
TRAIN = [
    "train",
    "--updates",
    "3",
    "--prompts-per-update",
    "4",
    "--group-size",
    "2",
    "--eval-prompts",
    "8",
    "--eval-samples",
    "2",
]


def status(run, cwd):
    proc = ouro("status", str(run), "--json", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_status_of_a_running_and_a_finished_run_and_plot(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OURO_TEST_FAULT="rollout@2=STOP", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ouro_cli.cli.app", *TRAIN, "--run-dir", str(run)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # stopped at the second rollout: one update is logged
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read())
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().split(") ")[1].split()[0] == "T":
                    break
            time.sleep(0.2)
        running = status(run, tmp_path)
        assert running["running"] and f"pid {proc.pid}" in running["holder"] and not running["complete"]
        assert (running["updates_done"], running["updates_total"]) == (1, 3)
        assert running["checkpoint"] is None and set(running["last_reward_per_k"]) == {"2"}
        assert set(running["accuracy_per_k"]) == {"2", "3", "4"}  # the evaluation before update 0
    finally:
        proc.send_signal(signal.SIGCONT)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()

    done = status(run, tmp_path)
    assert done["complete"] and not done["running"] and done["holder"] is None
    assert (done["updates_done"], done["updates_total"], done["next_update"]) == (3, 3, 3)
    assert done["checkpoint"]["next_update"] == 3 and done["checkpoint"]["path"].endswith("iter_0000003")
    assert set(done["last_reward_per_k"]) == {"2", "3", "4"} and len(done["plan_sha256"]) == 64
    end = {
        str(e["k"]): e
        for e in map(json.loads, (run / "evaluations.jsonl").read_text().splitlines())
        if e["when"] == "end"
    }
    assert {k: a["accuracy"] for k, a in done["accuracy_per_k"].items()} == {k: e["avg@2"] for k, e in end.items()}
    # every held-out response of the start and end evaluations, as `ouro eval` writes them
    responses = [json.loads(line) for line in (run / "responses.jsonl").read_text().splitlines()]
    assert [(r["when"], r["k"], r["sample"]) for r in responses] == [
        (when, k, s) for when in ("start", "end") for k in (2, 3, 4) for _ in range(8) for s in range(2)
    ]
    for when, e in [(e["when"], e) for e in map(json.loads, (run / "evaluations.jsonl").read_text().splitlines())]:
        mine = [r["reward"] for r in responses if r["when"] == when and r["k"] == e["k"]]
        assert sum(mine) / len(mine) == e["accuracy"]
    written = tmp_path / "status.txt"
    with written.open("w") as f:  # `ouro status RUN > f`: the report is the command's product, on stdout
        human = subprocess.run(
            [sys.executable, "-m", "ouro_cli.cli.app", "status", str(run)],
            cwd=tmp_path,
            env=env_for(),
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    report = written.read_text()
    assert human.returncode == 0 and human.stderr == "", human.stderr
    assert "complete" in report and "updates 3 of 3" in report and "last training reward" in report

    picture = tmp_path / "again.png"
    drawn = ouro("plot", str(run), "--out", str(picture), cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 20_000
    missing = ouro("status", str(tmp_path), cwd=tmp_path)
    assert missing.returncode == 2 and "is not an ouro run directory" in missing.stderr
