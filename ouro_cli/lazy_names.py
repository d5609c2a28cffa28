"""A package's names resolved on first use (PEP 562 module `__getattr__`), so that importing
the package, or one light module of it, does not import what its other modules need.

    __getattr__ = resolver(__name__, {"load": "loading", "OuroConfig": "config"})

`ouro_cli.model` and `ouro_cli.checkpoint` use it: the option tree and `ouro status` read
their light modules without torch or megatron-core.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def resolver(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of `package` that imports name N from its module `where[N]` on first use;
    any other name is an AttributeError."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{where[name]}", package), name)

    return __getattr__
