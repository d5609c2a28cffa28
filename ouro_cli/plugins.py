"""Objects named by a dotted path (`pkg.mod.attr`, `pkg.mod:attr`, `pkg.mod.Class.method`).

Reward functions (`--reward-function`) and engine factories (`--engine`) are plugins
named this way; this is the one resolver, and every way a path can be wrong is a
one-line `UserError` that names the path (`what` says which option it came from).
"""

from __future__ import annotations

import importlib
from typing import Any

from ouro_cli.errors import UserError


def _import_longest_prefix(path: str, dotted: str, what: str, example: str) -> tuple[Any, list[str]]:
    """Import the longest importable module prefix of `dotted`; return it and the attribute names left.
    Messages quote `path` as the user wrote it."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only "this prefix does not exist" means try a shorter one; a module that
            # exists but fails to import one of *its* dependencies is a real error.
            if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                continue
            raise UserError(f"{what} {path!r}: importing {module_name!r} failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a broken plugin module, reported in one line
            raise UserError(f"{what} {path!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
        return module, parts[cut:]
    raise UserError(f"{what} {path!r}: no module named {parts[0]!r}; give a dotted path such as {example}")


def resolve_callable(path: str, *, what: str, example: str) -> Any:
    """The callable that `path` names."""
    if not isinstance(path, str) or not path.strip():
        raise UserError(f"{what} must be a dotted path such as {example}, got {path!r}")
    dotted = path.strip().replace(":", ".")
    if "." not in dotted or any(not part.isidentifier() for part in dotted.split(".")):
        raise UserError(f"{what} {path!r} is not a dotted path such as {example}")
    obj, attributes = _import_longest_prefix(path, dotted, what, example)
    for i, name in enumerate(attributes):
        if not hasattr(obj, name):
            owner = ".".join(dotted.split(".")[: len(dotted.split(".")) - len(attributes) + i])
            raise UserError(f"{what} {path!r}: {owner!r} has no attribute {name!r}")
        obj = getattr(obj, name)
    if not callable(obj):
        raise UserError(f"{what} {path!r} is not callable (it is a {type(obj).__name__})")
    return obj
