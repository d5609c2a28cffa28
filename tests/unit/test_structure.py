"""The package's structure, read from its source: public faces, no import cycles, one reader of
the environment, a typed PD protocol.

- An underscore name is private to the module that defines it: no module of ouro_cli
  reads or calls a `_name` (attribute or import) that only another module of ouro_cli
  defines, whatever the object (`self._x` inherited from another module's class counts
  too). When a second module needs a private method, the class is missing a public one.
- The modules of ouro_cli import each other without a cycle, counting every import
  (module level, inside functions, under TYPE_CHECKING): an import inside a function
  may keep a heavy library off `ouro --help`'s path, never hide a cycle.
- Only ouro_cli/env.py touches the process environment (`os.environ`, `os.getenv`,
  `os.putenv`, `os.unsetenv`); every other module asks it.
- The engine's core is what its facade, the speculator and the decode worker drive.
- Every PD message is a frozen dataclass of pd/protocol.py, named in its documentation,
  and nothing is sent over a pipe as a bare tuple.

Each checker is also run on a small made-up package, so a passing test means it looked.
"""

from __future__ import annotations

import ast
import dataclasses
import pickle
import re
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ouro_cli"


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (the package `package`)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([package, *parts])] = path
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.Module) -> set[str]:
    """Names a module defines: top-level and class-level defs and assignments, and every
    attribute it assigns on any object (`self.x = ...`, `obj.x: T = ...`)."""
    names: set[str] = set()

    def targets(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Tuple | ast.List):
            for elt in node.elts:
                targets(elt)

    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                targets(target)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets(node.target)
    return names


def private_access_violations(root: Path, package: str) -> list[str]:
    """`file:line: _name` for each private name a module uses that only other modules define."""
    trees = {name: ast.parse(path.read_text()) for name, path in _modules(root, package).items()}
    defined = {name: _defined(tree) for name, tree in trees.items()}
    private: dict[str, set[str]] = {}
    for name, names in defined.items():
        for n in filter(_is_private, names):
            private.setdefault(n, set()).add(name)
    problems = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            used = []
            if isinstance(node, ast.Attribute):
                used = [node.attr]
            elif isinstance(node, ast.ImportFrom):
                used = [a.name for a in node.names]
            for n in used:
                owners = private.get(n, set()) if _is_private(n) else set()
                if owners and n not in defined[name]:
                    problems.append((name, node.lineno, n, sorted(owners)))
    return [f"{name}:{line}: {n} (defined in {', '.join(owners)})" for name, line, n, owners in sorted(problems)]


ENVIRONMENT = {"environ", "getenv", "putenv", "unsetenv", "getenvb", "environb"}


def environment_access(root: Path, package: str, reader: str) -> list[str]:
    """`module:line: os.name` for each touch of the process environment outside `reader`
    (`os.environ`, `os.getenv`, ..., and those names imported from os)."""
    problems = []
    for name, path in _modules(root, package).items():
        if name == reader:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ENVIRONMENT
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
            ):
                problems.append(f"{name}:{node.lineno}: os.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                problems += [f"{name}:{node.lineno}: os.{a.name}" for a in node.names if a.name in ENVIRONMENT]
    return problems


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a package's own __init__ when a name is
    imported from the package rather than a submodule)."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        graph[name].add(f"{base}.{a.name}")
                    elif base in modules:
                        graph[name].add(base)
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


# ---- the checkers look --------------------------------------------------------------------


def test_the_checkers_find_what_they_look_for(tmp_path):
    pkg = _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/engine.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from .speculative import Speculator
            def _helper(): ...
            class LLM:
                def _emit(self):
                    self._state = 1
                def generate(self):
                    return self._emit()
            """,
            "engine/speculative.py": """
            class Speculator:
                def step(self, eng):
                    from .engine import LLM
                    eng._emit()
                    eng._own()
                def _own(self): ...
            """,
            "engine/frontend.py": """
            class Base:
                def _hook(self): ...
            """,
            "engine/sub.py": """
            from .frontend import Base
            class Derived(Base):
                def run(self):
                    return self._hook(), self.__class__, self._mine
                def __init__(self):
                    self._mine = 0
            """,
            "rl/loop.py": """
            import os
            import torch
            from pkg.engine.engine import _helper
            def f(engine):
                torch._foreach_copy_([], [])
                return engine._state, os.environ.get("RANK"), os.path.join("a", "b")
            """,
            "cli/app.py": """
            from os import getenv
            from . import verify
            """,
            "cli/verify.py": """
            def train_options():
                from .app import app
            """,
            "env.py": """
            import os
            def rank():
                return int(os.environ.get("RANK", "0"))
            """,
        },
    )
    problems = private_access_violations(pkg, "pkg")
    assert [p.split(" (")[0] for p in problems] == [
        "pkg.engine.speculative:5: _emit",
        "pkg.engine.sub:5: _hook",
        "pkg.rl.loop:4: _helper",
        "pkg.rl.loop:7: _state",
    ], problems
    graph = import_graph(pkg, "pkg")
    assert cycles(graph) == [["pkg.cli.app", "pkg.cli.verify"], ["pkg.engine.engine", "pkg.engine.speculative"]]
    assert graph["pkg.engine.sub"] == {"pkg.engine.frontend"}
    assert environment_access(pkg, "pkg", "pkg.env") == ["pkg.cli.app:2: os.getenv", "pkg.rl.loop:7: os.environ"]


# ---- the package --------------------------------------------------------------------------


def test_no_module_uses_another_modules_private_names():
    problems = private_access_violations(PACKAGE, "ouro_cli")
    assert problems == [], "\n".join(problems)


def test_the_modules_import_each_other_without_a_cycle():
    graph = import_graph(PACKAGE, "ouro_cli")
    assert len(graph) > 120 and graph["ouro_cli.engine.core"] >= {
        "ouro_cli.engine.runner",
        "ouro_cli.engine.speculative",
    }
    assert cycles(graph) == []


def test_only_env_py_touches_the_environment():
    problems = environment_access(PACKAGE, "ouro_cli", "ouro_cli.env")
    assert problems == [], "\n".join(problems)


def test_the_plain_formulas_import_nothing_of_the_package():
    graph = import_graph(PACKAGE, "ouro_cli")
    assert graph["ouro_cli.model.formulas"] == set()
    assert "ouro_cli.model.formulas" in graph["ouro_cli.kernels.exact_rows"] & graph["ouro_cli.model.pointwise"]


# ---- the engine ---------------------------------------------------------------------------


def test_the_core_is_what_the_facade_the_speculator_and_the_decode_worker_drive():
    graph = import_graph(PACKAGE / "engine", "ouro_cli.engine")
    assert "ouro_cli.engine.core" in graph["ouro_cli.engine.engine"]
    assert "ouro_cli.engine.core" in graph["ouro_cli.engine.pd.worker"]
    assert "ouro_cli.engine.engine" not in graph["ouro_cli.engine.pd.worker"]  # workers need no facade
    assert "ouro_cli.engine.engine" not in graph["ouro_cli.engine.speculative"]
    assert graph["ouro_cli.engine.setup"].isdisjoint({"ouro_cli.engine.engine", "ouro_cli.engine.core"})


# ---- the PD protocol ----------------------------------------------------------------------


def _messages():
    from ouro_cli.engine.pd import protocol

    carried = {"WorkerCounters", "WorkerStats", "NewTokens", "Finished"}  # parts of messages
    return protocol, [
        obj
        for name, obj in vars(protocol).items()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == protocol.__name__
        and name not in carried
    ]


def test_every_pd_message_is_a_documented_frozen_dataclass():
    protocol, messages = _messages()
    assert len(messages) >= 20
    documented = set(re.findall(r"\b[A-Z][a-z]+(?:[A-Z][a-z]+)*\b", protocol.__doc__))
    for cls in messages:
        assert cls.__dataclass_params__.frozen, cls.__name__
        assert cls.__name__ in documented, f"{cls.__name__} is not in pd/protocol.py's documentation"


@pytest.mark.parametrize("i", range(3))
def test_pd_messages_survive_the_pipe(i):
    from ouro_cli.engine.contract import SamplingParams

    protocol, _ = _messages()
    stats = protocol.WorkerStats(protocol.WorkerCounters(tokens=3), {"decode_tokens": 2})
    msg = [
        protocol.Activate("7", 2, [1, 2], SamplingParams(max_tokens=4), 9),
        protocol.Tokens([protocol.NewTokens("7", [5], [4], [-0.5])], [protocol.Finished("7", "stop")], stats),
        protocol.Cancel(),
    ][i]
    assert pickle.loads(pickle.dumps(msg)) == msg


def test_nothing_is_sent_over_a_pipe_as_a_tuple():
    problems = []
    for path in sorted((PACKAGE / "engine" / "pd").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "send"
                and node.args
                and isinstance(node.args[0], ast.Tuple)
            ):
                problems.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert problems == []
