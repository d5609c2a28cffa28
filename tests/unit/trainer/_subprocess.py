"""Run a trainer worker script in its own process group and clean up after it.

Megatron's checkpoint saver spawns a multiprocessing manager; when a worker is killed
(the fault test) that helper outlives it, so each worker gets a new session and the
whole group is killed afterwards (only processes this helper started).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


def run_worker(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # Output goes to a file, not a pipe: an orphaned helper would keep a pipe open.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(args, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait()
        log.seek(0)
        return subprocess.CompletedProcess(args, proc.returncode, log.read(), "")


def python(script: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return run_worker([sys.executable, str(HERE / script), *args], **kwargs)
