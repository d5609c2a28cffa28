"""The run lock (ouro_cli.rl.lock): one holder at a time, named to whoever is refused;
a lock left by a killed process is taken over; `read_lock` reports without taking."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl.lock import LOCK_FILE, RunLock, RunLocked, read_lock


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run, "ouro train"):
        holder = read_lock(run)
        assert holder.pid == os.getpid() and holder.host == socket.gethostname() and holder.command == "ouro train"
        with pytest.raises(RunLocked, match=rf"is in use by pid {os.getpid()} on .*\(ouro train, since ") as err:
            RunLock(run, "ouro resume").acquire()
        assert isinstance(err.value, UserError) and "\n" not in str(err.value)
    assert read_lock(run) is None and not (run / LOCK_FILE).exists()  # released: removed
    with RunLock(run, "ouro resume"):
        assert read_lock(run).command == "ouro resume"


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path):
    run = tmp_path / "run"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from ouro_cli.rl.lock import RunLock
        RunLock({str(run)!r}, "ouro train").acquire()
        print("held", flush=True)
        time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "held"
    assert read_lock(run).pid == child.pid
    with pytest.raises(RunLocked, match=f"pid {child.pid}"):
        RunLock(run, "ouro resume").acquire()
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert read_lock(run) is None  # the file still names the dead holder, the lock is free
    notes = []
    with RunLock(run, "ouro resume", log=notes.append):
        assert read_lock(run).pid == os.getpid()
    assert len(notes) == 1 and f"pid {child.pid}" in notes[0] and "no longer running" in notes[0]


def test_resume_does_not_create_a_missing_directory(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        RunLock(tmp_path / "nothing", "ouro resume", create=False).acquire()
    assert not (tmp_path / "nothing").exists()


def test_a_directory_the_lock_created_goes_again_when_nothing_was_written(tmp_path):
    with RunLock(tmp_path / "refused", "ouro train"):
        assert (tmp_path / "refused" / LOCK_FILE).is_file()
    assert not (tmp_path / "refused").exists()  # e.g. a train refused for its data leaves nothing
    with RunLock(tmp_path / "used", "ouro train"):
        (tmp_path / "used" / "metrics.jsonl").write_text("")
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["metrics.jsonl"]
