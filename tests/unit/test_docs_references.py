"""Every page, section, module and file that the code's prose cites exists in the repository.

Docstrings and comments send the reader to the specification (`docs/model.md §3`), to other
modules (`ouro_cli.rl.publish`) and to files (`kernels/gemv.py`); a citation of
something renamed, or kept outside the repository, sends a newcomer nowhere. This reads
the prose only (Python docstrings and comments, shell comments, the Markdown pages), not
string literals, which tests use for deliberately wrong paths.

- `<page>.md`, `docs/<page>.md`: the page exists (beside the citing page, at the top or
  in docs/); a `§N` or `§N–M` after it names headings `## N.` of that page, and a
  `#anchor` after it (`docs/performance.md#decode`, in prose or in a link) names one of its
  headings as GitHub spells the anchor. Links of the Markdown pages resolve too.
- `ouro_cli.<package>.<module>[:<name>]`: modules and packages of the repository, then a
  name defined at the top level of the module reached (a def, a class, an assignment or
  an import).
- `<dir>/<file>.py`, `<file>.py`, `<file>.sh`: some file of the repository has that path,
  or ends with it (citations are often relative to the citing package). A file of another
  project is cited as `owner/repo:path` and is not looked for here.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("ouro_cli", "tests", "bench", "scripts", "examples", "docs")
TOP_FILES = ("README.md", "Makefile", ".ci/run")
SKIP_DIRS = {"__pycache__", ".venv", "build", ".git"}
# Files that a citation may name although the repository does not hold them: the public
# checkpoints' remote code, which travels with a checkpoint (docs/model.md §1).
EXTERNAL_FILES = {"configuration_ouro.py", "modeling_ouro.py"}

MD = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)\b(?:\s*§\s*(\d+)(?:\s*[–-]\s*(\d+))?)?")
MODULE = re.compile(r"\bouro_cli(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)?")
FILE = re.compile(r"(?<![\w/.*:-])((?:[\w-]+/)*[\w-]+\.(?:py|sh))\b")
MARKDOWN_LINK_TARGET = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MD_ANCHOR = re.compile(r"(?<![\w.-])((?:\.\./|[\w.-]+/)*[\w-]+\.md)#([\w-]+)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _files() -> list[Path]:
    found = [REPO / name for name in TOP_FILES if (REPO / name).is_file()]
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*")):
            if path.is_file() and not SKIP_DIRS & set(path.relative_to(REPO).parts):
                found.append(path)
    return found


def _prose(path: Path) -> str:
    """The parts of a file that are prose: docstrings and comments of Python, comments of
    shell scripts and Makefiles, all of a Markdown page."""
    text = path.read_text(errors="replace")
    if path.suffix == ".md":
        return text
    if path.suffix == ".py":
        parts = []
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    parts.append(doc)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                parts.append(tok.string)
        return "\n".join(parts)
    if path.suffix in ("", ".sh") or path.name == "Makefile":
        return "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    return ""


@cache
def _repo_paths() -> frozenset[str]:
    return frozenset(str(p.relative_to(REPO)) for p in _files())


def _md_target(name: str, citing: Path) -> Path | None:
    for candidate in (citing.parent / name, REPO / name, REPO / "docs" / name):
        if candidate.is_file():
            return candidate
    return None


def _sections(page: Path) -> set[int]:
    return {int(m.group(1)) for m in re.finditer(r"^##\s+(\d+)\.", page.read_text(), re.MULTILINE)}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE)}


@cache
def _top_level_names(module: Path) -> frozenset[str]:
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):  # a package's lazy names
                names.update(e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _module_problem(dotted: str) -> str | None:
    parts = re.split(r"[.:]", dotted)
    here = REPO / parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if (here / part / "__init__.py").is_file():
            here = here / part
        elif (here / f"{part}.py").is_file():
            here = here / f"{part}.py"
        else:
            module = here / "__init__.py" if here.is_dir() else here
            if part not in _top_level_names(module):
                return f"{'.'.join(parts[:i])} has no module or name {part!r}"
            return None  # a name inside a module; deeper attributes are not followed
    return None


def _citation_problems(path: Path, prose: str) -> list[str]:
    """What is wrong with the citations in `prose`, which `path` holds."""
    problems = []
    where = path.relative_to(REPO)
    for m in MD.finditer(prose):
        name, first, last = m.group(1), m.group(2), m.group(3) or m.group(2)
        target = _md_target(name, path)
        if target is None:
            problems.append(f"{where}: cites {name}, which is not in the repository")
        elif first is not None:
            missing = set(range(int(first), int(last) + 1)) - _sections(target)
            if missing:
                problems.append(f"{where}: cites {m.group(0)}, but {name} has no section {sorted(missing)}")
    for m in MD_ANCHOR.finditer(prose):
        name, anchor = m.group(1), m.group(2)
        target = next((c for c in (path.parent / name, REPO / name, REPO / "docs" / name) if c.is_file()), None)
        if target is None:
            problems.append(f"{where}: cites {name}, which is not in the repository")
        elif anchor not in _anchors(target):
            problems.append(f"{where}: cites {m.group(0)}, but {name} has no heading #{anchor}")
    for m in MODULE.finditer(prose):
        problem = _module_problem(m.group(0))
        if problem:
            problems.append(f"{where}: cites {m.group(0)}: {problem}")
    for m in FILE.finditer(prose):
        ref = m.group(1)
        if ref not in EXTERNAL_FILES and not any(p == ref or p.endswith("/" + ref) for p in _repo_paths()):
            problems.append(f"{where}: cites {ref}, which no file of the repository is")
    if path.suffix == ".md":
        for m in MARKDOWN_LINK_TARGET.finditer(prose):
            link = m.group(1)
            if "://" not in link and not (path.parent / link).exists():
                problems.append(f"{where}: links to {link}, which does not exist")
    return problems


def test_every_cited_page_section_module_and_file_exists():
    problems = [p for path in _files() for p in _citation_problems(path, _prose(path))]
    assert not problems, "\n".join(problems)


def test_the_spec_pages_exist_and_the_readme_links_them():
    for page in ("README.md", "model.md", "architecture.md", "performance.md"):
        assert (REPO / "docs" / page).is_file(), page
    assert "docs/README.md" in (REPO / "README.md").read_text()


@pytest.mark.parametrize(
    "prose, problem",
    [
        ("see OURO.md §3", "OURO.md, which is not in the repository"),
        ("see docs/model.md §5–6", "has no section [6]"),
        ("why: docs/performance.md#no-such-area", "has no heading #no-such-area"),
        ("see [the spec](../../docs/model.md#9-nowhere)", "has no heading #9-nowhere"),
        ("the replay (`ouro_cli.model.replay`)", "no module or name 'replay'"),
        ("`ouro_cli.engine.factory:no_such_factory`", "no module or name 'no_such_factory'"),
        ("written by kernels/nowhere.py", "kernels/nowhere.py, which no file"),
    ],
)
def test_a_dangling_citation_is_reported(prose, problem):
    """The checks bite: each kind of dangling citation is named."""
    problems = _citation_problems(REPO / "ouro_cli" / "engine" / "runner.py", prose)
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize(
    "prose",
    [
        "docs/model.md §3",
        "(model.md §2–3)",
        "why: docs/performance.md#decode",
        "[the spec](../../docs/model.md#3-execution-with-a-depth-budget)",
        "`ouro_cli.rl.publish`",
        "ouro_cli.engine.factory:default_factory",
        "ouro_cli.rl.rewards.boxed_answer",
        "kernels/gemv.py",
        "kv_cache.py",
        "modeling_ouro.py",
        "*.py",
    ],
)
def test_a_good_citation_passes(prose):
    assert _citation_problems(REPO / "ouro_cli" / "engine" / "runner.py", prose) == []
