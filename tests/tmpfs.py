"""A small tmpfs for tests of what happens when a disk is full (root mounts one; CI runs as root)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(size: str):
    """A fresh tmpfs of `size`, or a skip where this process may not mount one."""
    mount = Path("/tmp") / f"ouro-tmpfs-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        try:
            yield mount
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)
    finally:
        with contextlib.suppress(OSError):
            mount.rmdir()
