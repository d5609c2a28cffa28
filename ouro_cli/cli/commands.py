"""How the application presents its commands: the order `ouro --help` lists them in, and
each command's usage line.

- `Group` lists the commands in the order a newcomer meets them (`ORDER`: train first),
  the command groups (`convert`, `data`) among them, not after them as Typer would.
- `Command` writes a required argument in capitals in the usage line,
  `ouro eval [OPTIONS] MODEL`, as click and most CLIs do (Typer writes `{model}`); an
  optional one in brackets. Every command of the application is built with it (app.py).
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand, TyperGroup

ORDER = (
    "train",
    "resume",
    "eval",
    "data",
    "status",
    "plot",
    "export",
    "convert",
    "compare",
    "verify-resume",
    "probe-ucx",
)


class Group(TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda name: ORDER.index(name) if name in ORDER else len(ORDER))


class Command(TyperCommand):
    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":  # typer may vendor click: no isinstance
                pieces.append(_argument(param))
        return pieces


def _argument(param: Any) -> str:
    name = (param.metavar or param.name or "").upper()
    name = name if param.required else f"[{name}]"
    return f"{name}..." if param.nargs != 1 else name
