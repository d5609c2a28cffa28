"""The files that travel with the weights: tokenizer, generation config, chat templates, remote code.

An Ouro checkpoint loads through `trust_remote_code` (`configuration_ouro.py`,
`modeling_ouro.py`) and its tokenizer files; a conversion or export that dropped them
would produce a directory that no longer loads where the original did (docs/model.md §1).
They are copied verbatim. `config.json` is not among them: it is always rewritten from
the parsed `OuroConfig`, which keeps unknown keys.
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

ASSET_PATTERNS = (
    "*.py",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "generation_config.json",
    "chat_template*",
    "*.jinja",
)


def is_asset(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in ASSET_PATTERNS)


def asset_files(source_dir: Path) -> list[Path]:
    """The asset files directly inside `source_dir`, sorted by name."""
    source_dir = Path(source_dir)
    if not source_dir.is_dir():
        return []
    return sorted(p for p in source_dir.iterdir() if p.is_file() and is_asset(p.name))


def copy_assets(source_dir: Path | None, dest_dir: Path) -> list[str]:
    """Copy every asset file of `source_dir` into `dest_dir`; returns the names copied."""
    if source_dir is None:
        return []
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in asset_files(source_dir):
        shutil.copy2(path, dest_dir / path.name)
        copied.append(path.name)
    return copied
