"""Running `ouro` in subprocesses for the failure tests: several at once, with a fault point.

`OURO_TEST_FAULT` (ouro_cli/testing/faults.py) makes a process signal itself at a named
point; `run_all` runs independent commands concurrently (each pays seconds of imports).

Each command runs in a session of its own, and whatever is left of that session when the
command has ended is killed: a SIGKILLed `ouro train` leaves megatron-core's checkpoint
writer manager (a `multiprocessing` server process) behind, which would otherwise live on
and hold the output open. Output goes to files, not pipes, for the same reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def env_for(fault: str | None = None, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **extra,
    }
    env.pop("OURO_TEST_FAULT", None)
    env.pop("OURO_DEBUG", None)
    if fault:
        env["OURO_TEST_FAULT"] = fault
    return env


def start(*args: object, cwd: Path, fault: str | None = None, **extra: str) -> subprocess.Popen:
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ouro_cli.cli.app", *map(str, args)],
        cwd=cwd,
        env=env_for(fault, **extra),
        stdout=out,
        stderr=err,
        text=True,
        start_new_session=True,
    )
    proc.outputs = (out, err)
    return proc


def finish(proc: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
    try:
        proc.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what the command left running in its session
    texts = []
    for f in proc.outputs:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, *texts)


def run(*args: object, cwd: Path, fault: str | None = None, **extra: str) -> subprocess.CompletedProcess:
    return finish(start(*args, cwd=cwd, fault=fault, **extra))


@contextlib.contextmanager
def holding_lock(proc: subprocess.Popen, directory: Path, timeout: float = 120):
    """Once the command holds `directory`'s run lock, its whole session stopped (SIGSTOP) for the
    block, then continued: it keeps the lock's flock however long the block takes. Yields the
    holder (ouro_cli.rl.lock.read_lock)."""
    from ouro_cli.rl.lock import read_lock

    deadline = time.monotonic() + timeout
    while (holder := read_lock(directory)) is None:
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc).stderr
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield holder
    finally:
        os.killpg(proc.pid, signal.SIGCONT)


def run_all(*commands: list[object], cwd: Path) -> list[subprocess.CompletedProcess]:
    """Each command (an argument list) in its own process, all at the same time."""
    return [finish(p) for p in [start(*c, cwd=cwd) for c in commands]]


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one `error:` line a failed command printed (and nothing like a traceback)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def metrics_updates(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x)["update"] for x in path.read_text().splitlines()] if path.is_file() else []


def tracker(run_dir: Path) -> str | None:
    path = run_dir / "checkpoint" / "latest_checkpointed_iteration.txt"
    return path.read_text().strip() if path.is_file() else None
