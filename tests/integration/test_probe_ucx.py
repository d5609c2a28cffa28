"""`ouro probe-ucx` through the real CLI: NIXL missing (exit 2, install hint, one JSON
document) and, where the NIXL wheel is installed, a real probe on this machine's DRAM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def ouro(*args: str, cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    path = [str(extra_path)] if extra_path else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([*path, str(REPO)])}
    return subprocess.run(
        [sys.executable, "-m", "ouro_cli.cli.app", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture
def no_nixl(tmp_path) -> Path:
    """A directory that, first on PYTHONPATH, makes `import nixl` fail as on a machine without it."""
    stub = tmp_path / "stub" / "nixl"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named nixl (test stub)')\n")
    return stub.parent


def test_missing_nixl_exits_2_with_the_install_hint(tmp_path, no_nixl):
    proc = ouro("probe-ucx", cwd=tmp_path, extra_path=no_nixl)
    assert proc.returncode == 2
    assert "pip install nixl" in proc.stderr and "Traceback" not in proc.stderr
    proc = ouro("probe-ucx", "--tls", "tcp", "--json", cwd=tmp_path, extra_path=no_nixl)
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)  # exactly one JSON document, the error included
    assert doc["ok"] is False and doc["exit_code"] == 2 and "pip install nixl" in doc["error"]
    assert not (tmp_path / "probe.json").exists()


def test_real_probe_checks_delivery_and_recommends(tmp_path):
    pytest.importorskip("nixl._api", reason="NIXL is not installed here")
    proc = ouro("probe-ucx", "--size-mb", "1", "--repeats", "2", "--tls", "tcp", "--json", cwd=tmp_path)
    assert proc.returncode in (0, 1), proc.stderr
    doc = json.loads(proc.stdout)
    on_disk = json.loads((tmp_path / "probe.json").read_text())
    assert [r["label"] for r in on_disk["results"]] == ["default", "tcp,cuda_copy", "tcp"]
    for r in doc["results"]:
        if r["status"] == "delivered":  # delivered means every byte checked on the receiving side
            assert r["completed"] and r["notified"] == 2 and r["mismatched_bytes"] == 0
            assert r["bytes_checked"] == 1 << 20
    if proc.returncode == 0:
        best = doc["recommended"]
        assert best["label"] in {r["label"] for r in doc["results"] if r["status"] == "delivered"}
        assert "ouro train" in best["apply"]
    else:
        assert doc["ok"] is False and doc["recommended"] is None
