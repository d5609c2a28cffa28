"""A process forked by an `ouro` command dies when the command is killed (ouro_cli/children.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

CHILD_WAITS = """
import os, sys, time
from ouro_cli.children import die_with_this_process
die_with_this_process()
child = os.fork()
if child == 0:
    time.sleep(60)  # like megatron's idle checkpoint writer
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_forked_child_dies_with_its_killed_parent():
    parent = subprocess.Popen([sys.executable, "-c", CHILD_WAITS], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # alive while the parent lives
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:  # a zombie waiting for init to reap it is dead too
            if f.read().split(") ")[1].split()[0] == "Z":
                return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the forked child outlived its killed parent")
