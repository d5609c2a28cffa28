"""Importing megatron-core without compiling anything at import time.

megatron-core decorates its fused elementwise functions with `torch.compile` as its modules
load (`megatron.core.jit.jit_fuser`, bound to `torch.compile` when megatron.core.jit is
imported). Each decoration sets up TorchDynamo and asks Inductor for its configuration,
which imports Inductor's compiler: seconds of a command's start, for functions ouro never
calls (its model and loss are its own). `import_megatron_core` imports megatron-core with
`torch.compile` deferred: a decorated function is compiled by the real `torch.compile` with
the same arguments at its first call. torch.compile itself compiles at the first call, so
what runs is unchanged; only the setup moves from import time to that call.

Some of its modules (the inference context, the timers) also import the wandb client at import
time, for logging that ouro never asks of them; ouro's own tracker (rl/loggers.py) imports it
when a run logs to it. `import_megatron_core` hides wandb while megatron-core loads, so those
modules see it as not installed; a later `import wandb` imports it as usual.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any


def import_megatron_core() -> None:
    """Import `megatron.core` (once per process) with its import-time compilation deferred."""
    if "megatron.core" in sys.modules:
        return
    with _deferred_compile(), _hidden(TRACKERS):
        import megatron.core  # noqa: F401


# modules megatron-core imports at import time for logging that ouro never asks of it
TRACKERS = ("wandb",)


@contextlib.contextmanager
def _hidden(names: tuple[str, ...]) -> Iterator[None]:
    """`import name` raises ImportError inside the block for each of `names` not yet imported
    (a None entry in sys.modules); afterwards they import as usual."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


@contextlib.contextmanager
def _deferred_compile() -> Iterator[None]:
    import torch

    real = torch.compile
    torch.compile = _deferring(real)
    try:
        yield
    finally:
        torch.compile = real


def _deferring(real: Callable[..., Any]) -> Callable[..., Any]:
    """A `torch.compile` that hands a function to `real` at its first call."""

    def compile(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: compile(fn, **options)
        if not inspect.isfunction(model):  # a module: compiled as asked
            return real(model, **options)
        compiled = None

        @functools.wraps(model)
        def first_call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return first_call

    return compile
