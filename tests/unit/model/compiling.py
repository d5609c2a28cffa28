"""A test helper: record which pointwise functions compile, or forbid them to; `ALWAYS`, the
execution settings that compile them on CPU too."""

from __future__ import annotations

from ouro_cli.model import compiling
from ouro_cli.settings import ExecutionSettings

ALWAYS = ExecutionSettings(compile="always")


def record_compiles(monkeypatch) -> list[str]:
    """Route `compiling.compiled` through a recorder (uncached, so every compilation is seen)
    -> the names of the functions compiled, in order. On CPU only code running under settings
    that compile there (`ALWAYS`) compiles."""
    names: list[str] = []
    original = compiling.compiled.__wrapped__

    def record(fn, dynamic=None):
        names.append(fn.__name__)
        return original(fn, dynamic)

    monkeypatch.setattr(compiling, "compiled", record)
    return names


def forbid_compiles(monkeypatch) -> None:
    """Make any compilation of a pointwise function an AssertionError naming it."""

    def refuse(fn, dynamic=None):
        raise AssertionError(f"{fn.__name__} was compiled")

    monkeypatch.setattr(compiling, "compiled", refuse)
