"""The output guard: every command that writes a file or a directory goes through it.

The writers and their outputs: `train` (the run directory and `--export-hf`), `resume`
(`--export-hf`), `eval --out`, `export OUT`, `convert … OUT`, `verify-resume --work-dir` and
`plot --out` (tests/unit/cli/test_writers.py finds every path option of the app and checks
each output against these rules). An output

- may not equal, contain or lie inside an input of its command (`check_outside_inputs`), so
  `--overwrite` can never delete what the command reads;
- may not equal or lie inside a run directory's own files (`RunDir.own_paths`: the plan,
  `checkpoint/`, `rollouts/`, the records, the lock) nor inside a Megatron checkpoint (its
  iterations, tracker, `hf_assets/`), where it would replace a run's records or pass for an
  iteration (`check_outside_runs`); a new name inside a run directory, such as its `hf/`, is
  fine;
- must be creatable, which is probed by really creating a directory there (permission bits
  say nothing to root, nor about a read-only mount) (`check_writable`);
- replaces a non-empty directory (or an existing file) only with `--overwrite`.

An artifact (eval, export, convert, `--export-hf`, `plot --out`) is assembled in a hidden
staging sibling and renamed into place only when complete, so a crash leaves the old output
or nothing, never half of one. Its writer holds the output's lock (rl/lock.py `output_lock`)
from its checks until that rename (`claimed_output`), so of two writers of one output the
second is refused with one line naming the first, instead of silently replacing its result.
A run directory (train, resume, verify-resume) is written in place under its own lock.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .artifacts import real_path
from .errors import UserError
from .rl.lock import output_lock
from .rl.run_dir import RunDir

OVERWRITE_HINT = "pass --overwrite"


def check_outside_inputs(out: Path, inputs: Iterable[str | Path], what: str = "output") -> None:
    """Refuse an output that is, contains or lies inside an input (it would be replaced, emptied or hashed)."""
    resolved = real_path(out)
    for item in inputs:
        item = real_path(item)
        if resolved == item or resolved in item.parents or item in resolved.parents:
            raise UserError(f"{what} {resolved} overlaps the input {item}; choose a directory outside the input")


def check_outside_runs(out: Path, runs: Iterable[RunDir] = (), what: str = "output") -> None:
    """Refuse an output that is or lies inside a run directory's own files, or inside a Megatron
    checkpoint: of `runs` (the command's own, which may not exist yet) and of every run and
    checkpoint among the output's parents."""
    resolved = Path(out).resolve()
    known = [RunDir(Path(run.root).resolve()) for run in runs]
    known += [RunDir(parent) for parent in resolved.parents if RunDir(parent).is_run()]
    for run in known:
        for own in run.own_paths():
            if resolved == own or own in resolved.parents:
                raise UserError(
                    f"{what} {resolved} lies inside the run directory {run.root} ({own.name} is the "
                    "run's own); choose a directory outside the run's files"
                )
    # the checkpoint package imports torch: only a command that checks an output pays for it
    from ouro_cli.checkpoint.layout import is_megatron_checkpoint

    for parent in resolved.parents:
        if is_megatron_checkpoint(parent):
            raise UserError(
                f"{what} {resolved} lies inside the Megatron checkpoint {parent}; choose a directory outside it"
            )


def check_writable(out: Path, what: str = "output", *, file: bool = False) -> None:
    """`out` (or, where it does not exist yet, its nearest existing parent) must accept a new
    directory; an existing `out` must be a directory (a file, when `file`)."""
    out = Path(out)
    if out.exists() and out.is_dir() == file:
        raise UserError(f"{what} {out} exists and is {'a directory' if file else 'not a directory'}")
    base = next(p for p in (out.parent if file else out, *out.parents) if p.exists())
    if not base.is_dir():
        raise UserError(f"{what} {out} cannot be created: {base} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ouro-probe-", dir=base))
    except OSError as err:
        raise UserError(
            f"{what} {out} cannot be written ({base}: {err.strerror}); choose a writable directory"
        ) from None


def is_empty_dir(path: Path, ignore: Iterable[str] = ()) -> bool:
    ignored = set(ignore)
    return not Path(path).is_dir() or not any(p.name not in ignored for p in Path(path).iterdir())


def _taken(out: Path, file: bool) -> bool:
    """Whether `out` holds something a new output would replace."""
    return out.exists() if file else not is_empty_dir(out)


def check_output(
    out: Path,
    *,
    overwrite: bool,
    inputs: Iterable[str | Path] = (),
    runs: Iterable[RunDir] = (),
    what: str = "output",
    file: bool = False,
    hint: str = OVERWRITE_HINT,
) -> None:
    """The whole guard (module docstring): outside every input and every run's own files,
    writable, and empty (absent, for a file) unless `overwrite`; `hint` says how to replace it."""
    out = Path(out)
    check_outside_inputs(out, inputs, what)
    check_outside_runs(out, runs, what)
    check_writable(out, what, file=file)
    if not overwrite and _taken(out, file):
        raise UserError(f"{what} {out} {'exists' if file else 'is not empty'}; choose another or {hint}")


def clear_dir(path: Path, keep: Iterable[str] = ()) -> None:
    """Remove everything in `path` except the entries named in `keep` (a held lock file)."""
    kept = set(keep)
    for entry in Path(path).iterdir():
        if entry.name in kept:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@dataclass
class Output:
    """An output its writer has claimed (`claimed_output`): the guard's settings, to check it
    again with inputs found later, and to publish it whole (`staged`)."""

    path: Path
    overwrite: bool
    what: str = "output"
    file: bool = False
    hint: str = OVERWRITE_HINT
    runs: tuple[RunDir, ...] = field(default=())

    def check(self, inputs: Iterable[str | Path] = ()) -> None:
        check_output(
            self.path,
            overwrite=self.overwrite,
            inputs=inputs,
            runs=self.runs,
            what=self.what,
            file=self.file,
            hint=self.hint,
        )

    @contextlib.contextmanager
    def staged(self) -> Iterator[Path]:
        """A staging directory (for a file output: a staging file name with the output's
        suffix) beside the output; on success it replaces the output, on failure it vanishes.
        The caller writes an artifact's manifest and marker inside the block (marker last)."""
        out = self.path
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.with_name(
            f".{out.stem}.staging-{os.getpid()}{out.suffix}" if self.file else f".{out.name}.staging-{os.getpid()}"
        )
        _remove(staging)
        if not self.file:
            staging.mkdir()
        try:
            yield staging
            self._publish(staging)
        except BaseException:
            _remove(staging)
            raise

    def _publish(self, staging: Path) -> None:
        out = self.path
        if not self.overwrite and _taken(out, self.file):  # a writer that went round the guard
            raise UserError(
                f"{self.what} {out} was written by another process meanwhile; choose another or {self.hint}"
            )
        if out.is_dir() and not self.file:
            trash = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, trash)
            os.replace(staging, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, out)


@contextlib.contextmanager
def claimed_output(
    out: Path,
    *,
    overwrite: bool,
    command: str,
    inputs: Iterable[str | Path] = (),
    runs: Iterable[RunDir] = (),
    what: str = "output",
    file: bool = False,
    hint: str = OVERWRITE_HINT,
) -> Iterator[Output]:
    """Check `out` (`check_output`) and hold its lock for the block: the writer checks it again
    with any input it finds later (`Output.check`) and publishes it with `Output.staged`."""
    output = Output(Path(out), overwrite, what=what, file=file, hint=hint, runs=tuple(runs))
    inputs = list(inputs)
    output.check(inputs)  # before the lock: a refused output leaves nothing behind, not even a lock file
    with output_lock(output.path, command):
        output.check(inputs)  # holding it: a writer that finished meanwhile has published
        yield output


@contextlib.contextmanager
def staged_output(
    out: Path, *, overwrite: bool = False, command: str, inputs: Iterable[str | Path] = (), what: str = "output"
) -> Iterator[Path]:
    """`claimed_output` and `Output.staged` in one: yield a staging directory that replaces `out`
    whole on success (the caller writes the manifest and marker inside the block, marker last)."""
    with (
        claimed_output(out, overwrite=overwrite, command=command, inputs=inputs, what=what) as output,
        output.staged() as staging,
    ):
        yield staging
