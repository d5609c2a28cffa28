"""Artifact directories: written in a staging directory, published whole, marked complete last.

Every command's output directory holds `manifest.json` (command, resolved options, inputs
with sha256, package versions, git revision) and the marker file `COMPLETE`, written
after everything else. A directory without the marker is never consumed (`require_complete`).
Outputs are assembled in a hidden sibling staging directory and renamed into place only
when complete, so a crash leaves either the old directory or nothing — never a
half-written artifact under the requested name.

The one output guard (`check_output_dir`, used by every command that writes a directory:
train, eval, export, convert, verify-resume): the output may not equal, contain or lie
inside any input, so `--overwrite` can never delete what the command reads, and it must
be creatable, which is probed by really creating a directory there (permission bits say
nothing to root, nor about a read-only mount).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from .errors import UserError

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
_PACKAGES = ("ouro-cli", "torch", "megatron-core", "safetensors", "transformers", "tokenizers", "numpy",
             "sympy", "pylatexenc", "math-verify")  # the last three decide math rewards


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


def mark_complete(directory: Path) -> None:
    write_json_atomic(directory / MARKER, {"completed_unix": time.time()})


def is_complete(directory: Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def require_complete(directory: Path, what: str = "artifact") -> None:
    if not is_complete(directory):
        raise UserError(f"{directory} is not a complete {what} (no {MARKER} marker): it was not finished; re-run the command that makes it")


def check_outside_inputs(out: Path, inputs: Iterable[str | Path], what: str = "output") -> None:
    """Refuse an output that is, contains or lies inside an input (it would be replaced, emptied or hashed)."""
    resolved = real_path(out)
    for item in inputs:
        item = real_path(item)
        if resolved == item or resolved in item.parents or item in resolved.parents:
            raise UserError(f"{what} {resolved} overlaps the input {item}; choose a directory outside the input")


def real_path(path: str | Path) -> Path:
    """`path` with every symbolic link followed; a link loop is a UserError naming it."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):  # "Symlink loop from ..." (RuntimeError before Python 3.13)
        raise UserError(f"{path} is a symbolic link loop; point it at a real file or directory") from None


def check_writable(out: Path, what: str = "output") -> None:
    """`out` (or, where it does not exist yet, its nearest existing parent) must accept a new directory."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{what} {out} exists and is not a directory")
    base = next(p for p in (out, *out.parents) if p.exists())
    if not base.is_dir():
        raise UserError(f"{what} {out} cannot be created: {base} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ouro-probe-", dir=base))
    except OSError as err:
        raise UserError(f"{what} {out} cannot be written ({base}: {err.strerror}); choose a writable directory") from None


def is_empty_dir(path: Path, ignore: Iterable[str] = ()) -> bool:
    ignored = set(ignore)
    return not Path(path).is_dir() or not any(p.name not in ignored for p in Path(path).iterdir())


def check_output_dir(out: Path, overwrite: bool, inputs: Iterable[str | Path] = ()) -> None:
    """The output guard: outside every input, writable, and empty unless `overwrite`."""
    out = Path(out)
    check_outside_inputs(out, inputs)
    check_writable(out)
    if not is_empty_dir(out) and not overwrite:
        raise UserError(f"output directory {out} is not empty; choose another or pass --overwrite")


def clear_dir(path: Path, keep: Iterable[str] = ()) -> None:
    """Remove everything in `path` except the entries named in `keep` (a held lock file)."""
    kept = set(keep)
    for entry in Path(path).iterdir():
        if entry.name in kept:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


@contextlib.contextmanager
def staged_output(out: Path, *, overwrite: bool = False, inputs: Iterable[str | Path] = ()) -> Iterator[Path]:
    """Yield a staging directory; on success it replaces `out`, on failure it vanishes.

    The caller writes the manifest and marker inside the block (marker last).
    """
    out = Path(out)
    check_output_dir(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        trash = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, trash)
        os.replace(staging, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, out)
