"""Building a module on the meta device, shapes only, without running its random init.

A meta tensor holds no data, so the in-place random fills of a module's `__init__`
(`normal_`, `uniform_`, `torch.nn.init`) have nothing to fill; run anyway, torch's meta
implementation of them imports torch._dynamo, which is slow. Inside `on_meta()` they
return their tensor untouched; whatever the module holds comes from a state dict later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _SkipInit(TorchFunctionMode):
    _INIT = {torch.Tensor.normal_, torch.Tensor.uniform_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._INIT or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built in this block are on the meta device, their random init skipped."""
    with torch.device("meta"), _SkipInit():
        yield
