"""The files that travel with the weights: tokenizer, generation config, chat templates, remote code.

An Ouro checkpoint loads through `trust_remote_code` (`configuration_ouro.py`,
`modeling_ouro.py`) and its tokenizer files; a conversion or export that dropped them
would produce a directory that no longer loads where the original did (docs/model.md §1).
They are copied verbatim. `config.json` is not among them: it is always rewritten from
the parsed `OuroConfig`, which keeps unknown keys, save that its `auto_map` names only the
remote code the directory holds (`naming_present_code`): transformers imports whatever
`auto_map` names, so an entry for a file that did not travel (a source without remote code,
such as the bundled tiny model) would make the directory fail to load.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import shutil
from pathlib import Path
from typing import Any

from ouro_cli.model.config import OuroConfig

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


def naming_present_code(config: OuroConfig, directory: Path) -> OuroConfig:
    """`config` with only the `auto_map` entries whose remote code is in `directory` (the
    whole key dropped when none is). An entry names `module.Class` (its code in the directory),
    a list of such names or None (a tokenizer's slow and fast classes), or
    `repo--module.Class`, code in another repository, which is kept."""
    auto_map = config.extra.get("auto_map")
    if not isinstance(auto_map, dict):
        return config
    kept = {key: value for key, value in auto_map.items() if _code_present(value, Path(directory))}
    extra = {k: v for k, v in config.extra.items() if k != "auto_map"} | ({"auto_map": kept} if kept else {})
    return dataclasses.replace(config, extra=extra)


def _code_present(reference: Any, directory: Path) -> bool:
    if isinstance(reference, list | tuple):
        return all(_code_present(r, directory) for r in reference)
    if reference is None or (isinstance(reference, str) and "--" in reference):
        return True
    module = str(reference).rpartition(".")[0]
    return bool(module) and (directory / f"{module.replace('.', '/')}.py").is_file()
