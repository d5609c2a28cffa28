"""A test helper: make every pointwise function compile from here on, on CPU too, and
record which ones do."""

from __future__ import annotations

from ouro_cli.model import pointwise


def record_compiles(monkeypatch) -> list[str]:
    """Set OURO_COMPILE=always and route `pointwise._compiled` through a recorder (uncached,
    so every compilation is seen) -> the names of the functions compiled, in order."""
    names: list[str] = []
    original = pointwise._compiled.__wrapped__

    def record(fn, dynamic=None):
        names.append(fn.__name__)
        return original(fn, dynamic)

    monkeypatch.setattr(pointwise, "_compiled", record)
    monkeypatch.setenv("OURO_COMPILE", "always")
    return names


def forbid_compiles(monkeypatch) -> None:
    """Make any compilation of a pointwise function an AssertionError naming it."""
    def refuse(fn, dynamic=None):
        raise AssertionError(f"{fn.__name__} was compiled")

    monkeypatch.setattr(pointwise, "_compiled", refuse)
