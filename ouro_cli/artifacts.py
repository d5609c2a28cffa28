"""Artifact directories: a manifest, and a marker written last.

Every command's output directory holds `manifest.json` (command, resolved options, inputs
with sha256, package versions, git revision) and the marker file `COMPLETE`, written
after everything else. A directory without the marker is never consumed (`require_complete`).
Where an output may go, and how it is published whole, is the output guard's
(ouro_cli/outputs.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from .errors import UserError

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
_PACKAGES = (
    "ouro-cli",
    "torch",
    "megatron-core",
    "safetensors",
    "transformers",
    "tokenizers",
    "numpy",
    "sympy",
    "pylatexenc",
    "math-verify",
)  # the last three decide math rewards


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def describe_inputs(paths: list[Path]) -> list[dict[str, Any]]:
    """Each input file (directories: every regular file below them) with its sha256."""
    described = []
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            described.append({"path": str(f.resolve()), "bytes": f.stat().st_size, "sha256": sha256_file(f)})
    return described


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_revision() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def write_manifest(directory: Path, command: str, options: dict[str, Any], inputs: list[Path]) -> dict[str, Any]:
    manifest = {
        "command": command,
        "argv": sys.argv,
        "options": options,
        "inputs": describe_inputs(inputs),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "git_revision": git_revision(),
        "created_unix": time.time(),
    }
    write_json_atomic(directory / MANIFEST, manifest)
    return manifest


def mark_complete(directory: Path, details: dict[str, Any] | None = None) -> None:
    """Write the directory's marker, last: the time, and `details` (what its job measured at the end)."""
    write_json_atomic(directory / MARKER, {"completed_unix": time.time(), **(details or {})})


def is_complete(directory: Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def require_complete(directory: Path, what: str = "artifact") -> None:
    if not is_complete(directory):
        raise UserError(
            f"{directory} is not a complete {what} (no {MARKER} marker): it was not finished; re-run the command that "
            f"makes it"
        )


def real_path(path: str | Path) -> Path:
    """`path` with every symbolic link followed; a link loop is a UserError naming it."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):  # "Symlink loop from ..." (RuntimeError before Python 3.13)
        raise UserError(f"{path} is a symbolic link loop; point it at a real file or directory") from None
