"""The package layout in docs/architecture.md §1 matches the tree.

The layout is the newcomer's map, so it may neither name a path that is gone nor leave out a
part of the package. The section's indented block lists one entry a line (`model/`,
`config.py`, `tests/`), nested by indentation, each followed by what it holds; the
description may name files or folders too (`unique_rows.py`, `pd/`). Every entry and every
such name must exist (an entry under its parent; a name in a description under its entry,
a folder above it, or the repository's root), and every package and module at the top of
`ouro_cli/` must be an entry.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
SECTION = "## 1. Package layout"
# An entry: its name, then two or more spaces and its description (or nothing); a line that
# continues a description has one space after its first word.
ENTRY = re.compile(r"^( {4,})((?:[\w.-]+/)|(?:[\w-]+\.\w+))(?: {2,}(.*))?$")
NAMED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+(?:\.py|\.sh|/))(?![\w/])")
UNLISTED = {"__init__.py", "__pycache__", "py.typed"}


def _layout_block(text: str) -> list[str]:
    """The indented lines of the layout section's first code block."""
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines, started = [], False
    for line in section.splitlines():
        if line.startswith("    ") and line.strip():
            started = True
            lines.append(line)
        elif started and line.strip():
            break
    return lines


def layout_problems(text: str, root: Path) -> list[str]:
    """What the layout block of `text` gets wrong about the tree under `root`."""
    problems, named_in_package = [], set()
    parents: list[tuple[int, Path]] = []  # (indent, folder) of the open entries
    entry_dir = root
    for line in _layout_block(text):
        m = ENTRY.match(line)
        if m:
            indent, first, rest = len(m.group(1)), m.group(2), m.group(3) or ""
            while parents and parents[-1][0] >= indent:
                parents.pop()
            base = parents[-1][1] if parents else root
            path = base / first.rstrip("/")
            if not path.exists():
                problems.append(f"the layout names {path.relative_to(root)}, which does not exist")
            if base == root / "ouro_cli":
                named_in_package.add(first.rstrip("/"))
            if first.endswith("/"):
                parents.append((indent, path))
            entry_dir = path if first.endswith("/") else base
            description = rest
        else:
            description = line
        for name in NAMED.findall(description):
            bases = [entry_dir, *(p for _, p in reversed(parents)), root]
            if not any((b / name.rstrip("/")).exists() for b in bases):
                problems.append(
                    f"the layout's description of {entry_dir.relative_to(root)} names {name}, which does not exist"
                )
    package = root / "ouro_cli"
    for child in sorted(package.iterdir()):
        if child.name in UNLISTED or child.name.startswith(".") or child.suffix == ".pyc":
            continue
        if child.name not in named_in_package:
            problems.append(f"ouro_cli/{child.name} is not in the layout")
    return problems


def test_the_layout_section_matches_the_tree():
    problems = layout_problems(PAGE.read_text(), REPO)
    assert not problems, "\n".join(problems)


def test_the_layout_lists_many_entries():
    """The parser reads the real section: the block is found and its entries are seen."""
    lines = _layout_block(PAGE.read_text())
    assert any(line.strip().startswith("ouro_cli/") for line in lines)
    assert sum(1 for line in lines if (m := ENTRY.match(line)) and m.group(2).endswith("/")) >= 10


def _tree(tmp_path: Path) -> Path:
    for path in (
        "ouro_cli/model/ouro.py",
        "ouro_cli/cli/app.py",
        "ouro_cli/config.py",
        "ouro_cli/__init__.py",
        "tests/unit/x.py",
        "docs/log/a.md",
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    return tmp_path


LAYOUT = """# Page

## 1. Package layout

    ouro_cli/
      model/        the model (ouro.py)
      cli/          the command line
      config.py     options
    tests/          unit
    docs/           these pages; docs/log/ the history

Why.

## 2. Next
"""


def test_a_matching_layout_passes(tmp_path):
    assert layout_problems(LAYOUT, _tree(tmp_path)) == []


def test_a_missing_path_and_an_unnamed_package_are_reported(tmp_path):
    root = _tree(tmp_path)
    (root / "ouro_cli" / "runs").mkdir()
    text = LAYOUT.replace("      cli/          the command line\n", "      tools/        back-ends (gone.py)\n")
    problems = layout_problems(text, root)
    assert "the layout names ouro_cli/tools, which does not exist" in problems
    assert any("names gone.py" in p for p in problems)
    assert "ouro_cli/cli is not in the layout" in problems
    assert "ouro_cli/runs is not in the layout" in problems
