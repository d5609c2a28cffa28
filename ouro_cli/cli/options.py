"""Command-line flags built from an option tree (ouro_cli/config.py).

A command whose options are a tree does not spell its flags out: `with_options` gives
its function one keyword parameter per option, named by the option's flat name, with the
option's flag, help line, panel and default (`[default: ...]`, from the field's default
or the words the option states for a None or a path), and the environment variable that
stands in for it when it is not given. Every parameter defaults to None,
so that a value the user did not give can come from elsewhere (a TOML file, the run's
plan); the command resolves them (rl/options.py `resolve`). Further spellings of a flag
are hidden aliases (common.hidden_alias), so that the help's option column fits 80
columns.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import MISSING
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import typer

from ouro_cli.config import P_DATA, P_ENGINE, P_EXEC, P_GRPO, P_OPT, P_RUN, Leaf
from ouro_cli.defaults import AUTO

from .common import JSON_OPTION, hidden_alias

PANEL_ORDER = (P_DATA, P_GRPO, P_OPT, P_ENGINE, P_EXEC, P_RUN)


class NumberOrAuto:
    """Parses a number of one type, or the word `auto` (an option whose default follows the
    model, ouro_cli/defaults.py)."""

    def __init__(self, kind: type) -> None:
        self.kind = kind

    def __call__(self, value: Any) -> Any:
        if value == AUTO or (isinstance(value, self.kind) and not isinstance(value, bool)):
            return value
        try:
            return self.kind(value)
        except (TypeError, ValueError):
            wanted = "an integer" if self.kind is int else "a number"
            raise typer.BadParameter(f"{value!r} is not {wanted} or auto") from None


def auto_number(annotation: Any) -> type | None:
    """int or float for an option typed `int | Literal["auto"]` or `float | Literal["auto"]`."""
    if get_origin(annotation) not in (Union, UnionType):
        return None
    args = get_args(annotation)
    numbers = [t for t in args if t in (int, float)]
    autos = [t for t in args if get_origin(t) is Literal and get_args(t) == (AUTO,)]
    return numbers[0] if len(numbers) == 1 and autos and len(args) == 2 else None


def cli_type(annotation: Any) -> Any:
    """The type Typer parses an option as: a Literal is a string (its values are checked by the
    config, with the config's message), `X | None` stays optional, a number or auto is a string
    that `NumberOrAuto` converts."""
    if auto_number(annotation) is not None:
        return str
    origin = get_origin(annotation)
    if origin is Literal:
        return str
    if origin in (Union, UnionType):
        inner = [cli_type(t) for t in get_args(annotation) if t is not type(None)]
        return inner[0] if len(inner) == 1 else annotation
    return annotation


def parameter(
    leaf: Leaf, *, help: str | None = None, default: str | None = None, panels: bool = True
) -> inspect.Parameter:
    """The keyword parameter of one option: its flag (or argument), help and default text."""
    if leaf.info.argument:
        info: Any = typer.Argument(help=help or leaf.info.help, show_default=False)
        return inspect.Parameter(
            leaf.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[cli_type(leaf.type), info]
        )
    for alias in leaf.info.aliases:
        hidden_alias(alias, leaf.flag.split("/")[0])  # "--async-save/--sync-save": the first is the name
    required = leaf.default is MISSING
    text = help or leaf.info.help
    if leaf.info.env and help is None:
        text = f"{text} Or set {leaf.info.env}."  # the environment stands in for it (ouro_cli/settings.py)
    if not required:
        text = f"{text} \\[default: {leaf.shown_default if default is None else default}]"
    number = auto_number(leaf.type)
    info = typer.Option(
        leaf.flag,
        help=text,
        rich_help_panel=leaf.info.panel if panels else None,
        show_default=False,
        metavar=leaf.info.metavar or ({int: "<int|auto>", float: "<num|auto>"}[number] if number else None),
        parser=NumberOrAuto(number) if number else None,
    )
    if required:
        return inspect.Parameter(
            leaf.name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[cli_type(leaf.type), info]
        )
    return inspect.Parameter(
        leaf.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[cli_type(leaf.type) | None, info]
    )


NEGATED = "no__"  # the parameter of a boolean's hidden --no-X flag: "no__" + the option's name


def parameters(leaf: Leaf, **kwargs: Any) -> list[inspect.Parameter]:
    """`parameter(leaf)`, and for a boolean flag its hidden `--no-X` (so that a TOML file's `true`
    can be turned off from the command line): accepted, not listed, so the help's option column
    keeps the width of the names (`with_options` turns it into the option's False)."""
    main = parameter(leaf, **kwargs)
    if leaf.info.argument or cli_type(leaf.type) is not bool or "/" in leaf.flag:
        return [main]
    negative = typer.Option(f"--no-{leaf.flag[2:]}", hidden=True)
    return [
        main,
        inspect.Parameter(
            NEGATED + leaf.name, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[bool, negative]
        ),
    ]


def fold_negations(params: dict[str, Any]) -> dict[str, Any]:
    """Parsed parameters with each hidden `--no-X` given turned into X = False (`parameters`)."""
    out = {k: v for k, v in params.items() if not k.startswith(NEGATED)}
    out.update({k[len(NEGATED) :]: False for k, v in params.items() if k.startswith(NEGATED) and v})
    return out


def json_parameter() -> inspect.Parameter:
    """`--json`, the flag every command has (common.JSON_OPTION), as a parameter."""
    return inspect.Parameter(
        "json_output",
        inspect.Parameter.KEYWORD_ONLY,
        default=False,
        annotation=Annotated[bool, typer.Option("--json", help=JSON_OPTION.help, show_default=False)],
    )


def by_panel(leaves: Iterable[Leaf]) -> list[Leaf]:
    """Leaves ordered by help panel (the order of PANEL_ORDER), declaration order within one."""
    return sorted(
        leaves,
        key=lambda leaf: PANEL_ORDER.index(leaf.info.panel) if leaf.info.panel in PANEL_ORDER else len(PANEL_ORDER),
    )


def with_options(
    body: Callable[..., Any],
    options: list[inspect.Parameter],
    *,
    head: Iterable[inspect.Parameter] = (),
    tail: Iterable[inspect.Parameter] = (),
) -> Callable[..., Any]:
    """`body(**params)` as a function whose signature is `head`, then `options`, then `tail`,
    for Typer to read (it reads `__signature__` and the annotations)."""

    @functools.wraps(body)
    def command(**params: Any) -> Any:
        return body(**fold_negations(params))

    parameters = [*head, *options, *tail]
    positional = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in parameters
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    command.__signature__ = inspect.Signature([*positional, *keyword])
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    del command.__wrapped__  # inspect.signature must read __signature__, not the body's
    return command
