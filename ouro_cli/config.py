"""The option tree: a command's options as nested, typed dataclasses.

A command's options are one root dataclass (`rl.options.TrainOptions`, `EvalOptions`)
whose *sections* are other config dataclasses (the trainer's `TrainerConfig`, the engine
options, the `ExecutionSettings`, ...), so that each default, help line and check is
written once, beside its field. Everything outside the code maps onto the tree by *flat
names*:

- the command line: one flag per option, built from the option's name, help line,
  panel and default (cli/options.py), so the help cannot disagree with the default;
- a TOML `--config` file: flat keys (`lr = 1e-4`), or the same keys under any [heading];
  a heading that names a section of the tree (`[trainer]`, `[engine]`, or a dotted key
  `trainer.lr`) must hold that section's options (`read_toml`);
- the recorded options (`manifest.json`, `ouro-plan.json`): one flat dict (`flat`), read
  back with `build`.

An *option* is a field declared with `option(...)`. Its flat name is the field's name
unless `name=` says otherwise, and is unique in the whole tree (checked). A *section* is
a field declared with `section(Cls)`. Any other field of a config class belongs to the
Python API alone: no flag, no TOML key, never recorded (`TrainerConfig.decay_steps`, which
the job derives from its number of updates, is one).
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from ouro_cli.errors import UserError

# The panels of the command-line help, in the order a command shows them.
P_DATA, P_GRPO, P_OPT, P_ENGINE, P_EXEC, P_RUN = (
    "Model and data",
    "GRPO update",
    "Optimizer",
    "Engine",
    "Execution (kernels, compilation)",
    "Run, save, evaluate",
)

T = TypeVar("T")


@dataclass(frozen=True)
class OptionInfo:
    help: str
    panel: str | None = None
    name: str | None = None  # the flat name, when it is not the field's name
    flag: str | None = None  # the flag as the help shows it, when it is not --<name>
    aliases: tuple[str, ...] = ()  # further spellings, accepted and not shown
    shown: str | None = None  # how the help states a default that is None or a path
    env: str | None = None  # the environment variable that stands in for the option (settings.py)
    argument: bool = False  # a positional argument instead of a flag
    metavar: str | None = None  # how the help names the value, when not by its type


def option(
    default: Any = MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    help: str,
    panel: str | None = None,
    name: str | None = None,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    shown: str | None = None,
    env: str | None = None,
    argument: bool = False,
    metavar: str | None = None,
) -> Any:
    """A field that is an option of the tree (module docstring)."""
    metadata = {
        "option": OptionInfo(
            help=help,
            panel=panel,
            name=name,
            flag=flag,
            aliases=aliases,
            shown=shown,
            env=env,
            argument=argument,
            metavar=metavar,
        )
    }
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type) -> Any:
    """A field holding a nested config dataclass, with that class's defaults."""
    return field(default_factory=cls, metadata={"section": cls})


@dataclass(frozen=True)
class Leaf:
    """One option of a tree, by its flat name."""

    name: str
    path: tuple[str, ...]  # attribute names from the root to the field
    info: OptionInfo
    type: Any
    default: Any  # MISSING when the option is required

    @property
    def flag(self) -> str:
        return self.info.flag or "--" + self.name.replace("_", "-")

    @property
    def shown_default(self) -> str:
        """The default as the help states it: the value (booleans on/off, lists space-separated),
        or the option's own words for a default that is None or a path."""
        if self.info.shown is not None:
            return self.info.shown
        return render(self.default)

    def get(self, tree: Any) -> Any:
        for part in self.path:
            tree = getattr(tree, part)
        return tree


def render(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return " ".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def at_least(minimum: int, **values: int | None) -> None:
    """Each option given (not None) must be at least `minimum`; the first that is not is a
    UserError naming its flag."""
    for name, value in values.items():
        if value is not None and value < minimum:
            raise UserError(f"--{name.replace('_', '-')} must be at least {minimum}, got {value}")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


@functools.cache
def leaves(root: type) -> dict[str, Leaf]:
    """Every option of the tree rooted at `root`, by flat name, in declaration order (sections
    in place)."""
    found: dict[str, Leaf] = {}

    def walk(cls: type, path: tuple[str, ...]) -> None:
        hints = get_type_hints(cls)
        for f in fields(cls):
            if "section" in f.metadata:
                walk(f.metadata["section"], (*path, f.name))
                continue
            info = f.metadata.get("option")
            if info is None:
                continue
            name = info.name or f.name
            if name in found:
                raise TypeError(f"{root.__name__}: two options are named {name!r}")
            found[name] = Leaf(name, (*path, f.name), info, hints[f.name], _default(f))

    walk(root, ())
    return found


@functools.cache
def sections(root: type) -> dict[str, set[str]]:
    """Section name -> the flat names of its options (nested sections included)."""
    out: dict[str, set[str]] = {}
    for leaf in leaves(root).values():
        for depth in range(1, len(leaf.path)):
            out.setdefault(leaf.path[depth - 1], set()).add(leaf.name)
    return out


def build(root: type[T], values: Mapping[str, Any], *, where: str = "option", check: bool = True) -> T:
    """The tree of `root` with `values` (by flat name) over its defaults. With `check`, every
    value must have its option's type (`check_types`); an integer given for a float becomes one."""
    table = leaves(root)
    unknown = sorted(set(values) - set(table))
    if unknown:
        raise UserError(f"{where}: unknown option {unknown[0]!r}")
    if check:
        check_types(root, values, where)
    nested: dict[str, Any] = {}
    for name, value in values.items():
        leaf = table[name]
        if _takes_float(leaf.type) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        node = nested
        for part in leaf.path[:-1]:
            node = node.setdefault(part, {})
        node[leaf.path[-1]] = value
    return _construct(root, nested)


def _takes_float(expected: Any) -> bool:
    """A float option, or one that is a float or a word (`float | Literal["auto"]`)."""
    if get_origin(expected) in (Union, UnionType):
        args = get_args(expected)
        return float in args and int not in args
    return expected is float


def _construct(cls: type[T], values: dict[str, Any]) -> T:
    kwargs = {}
    for f in fields(cls):
        if f.name in values:
            kwargs[f.name] = (
                _construct(f.metadata["section"], values[f.name]) if "section" in f.metadata else values[f.name]
            )
    return cls(**kwargs)


def flat(tree: Any) -> dict[str, Any]:
    """The tree's options as one flat dict (what the manifest and the plan record)."""
    return {name: leaf.get(tree) for name, leaf in leaves(type(tree)).items()}


def read_toml(path: str | Path, root: type) -> dict[str, Any]:
    """Options from a TOML file, by flat name (dashes or underscores), each value of its
    option's type. Keys may stand at the top, under any [heading], or under a heading that
    names a section of the tree, which must then hold them. An option set twice (under two
    headings, or as `max_response_len` and `max-response-len`) is refused: which one wins
    would be a guess."""
    path = Path(path)
    where = f"--config {path}"
    if not path.is_file():
        raise UserError(f"{where} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{where} is not valid TOML: {err}") from err
    table, owned = leaves(root), sections(root)
    values: dict[str, Any] = {}
    set_at: dict[str, str] = {}

    def take(node: Mapping[str, Any], heading: str | None) -> None:
        for key, value in node.items():
            name = key.replace("-", "_")
            if isinstance(value, dict):  # a heading: no option takes a table ([data] above data = "...")
                take(value, name if heading is None else f"{heading}.{name}")
                continue
            if name not in table:
                raise UserError(f"{where}: unknown option {name!r}")
            section = heading.rpartition(".")[2] if heading else None
            if section in owned and name not in owned[section]:
                raise UserError(f"{where}: {name} is not an option of [{section}]")
            at = f"[{heading}]" if heading else "the top level"
            if name in set_at:
                raise UserError(f"{where}: {name} is set twice, at {set_at[name]} and at {at}; keep one")
            set_at[name] = at
            values[name] = value

    take(raw, None)
    check_types(root, values, where)
    return values


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def check_types(root: type, values: Mapping[str, Any], where: str) -> None:
    """Every value must have its option's type (the field annotations): an int is a float, a
    bool is not an int, a list holds its element type, a Literal is one of its values; a
    mismatch names the key."""
    table = leaves(root)
    for key, value in values.items():
        expected = table[key].type
        if not _has_type(value, expected):
            raise UserError(f"{where}: {key} must be {_wanted(expected)}, got {value!r} ({type(value).__name__})")


def _has_type(value: Any, expected: Any) -> bool:
    origin = get_origin(expected)
    if origin in (Union, UnionType):
        return any(_has_type(value, t) for t in get_args(expected))
    if origin is Literal:
        return isinstance(value, str) and value in get_args(expected)
    if origin is list:
        return isinstance(value, list) and all(_has_type(v, get_args(expected)[0]) for v in value)
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _wanted(expected: Any) -> str:
    if get_origin(expected) in (Union, UnionType):
        return " or ".join(_describe(t) for t in get_args(expected) if t is not type(None))
    return _describe(expected)


def _describe(expected: Any) -> str:
    if get_origin(expected) is Literal and len(get_args(expected)) == 1:
        return get_args(expected)[0]
    if get_origin(expected) is list:
        return f"a list of {_describe(get_args(expected)[0]).removeprefix('an ').removeprefix('a ')}s"
    if get_origin(expected) is Literal:
        return "one of " + ", ".join(get_args(expected))
    return _TYPE_NAMES.get(expected, getattr(expected, "__name__", str(expected)))
