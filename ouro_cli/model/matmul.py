"""The model's projections, with a hook for the engine's small-batch matmul kernel.

Every weight multiplication of the model goes through `linear(x, w)` (= F.linear). `w` may
also be a sequence of weights [N_i, K] that share the input (q, k, v; gate, up): they are
multiplied as one stacked matrix, in one product, and stay separate tensors with gradients
of their own (the trainer's parameters keep their Hugging Face names and shapes). A
caller may install, for the duration of a `with use_small_batch(kernel, max_rows)`
block, a kernel that takes over products whose input has at most `max_rows` rows. The
engine's decode step on CUDA installs its Triton small-batch kernel there (`--decode-gemv`,
kernels/gemv.py: on a given weight its rows have the bits cuBLAS gives at the
replay's many rows, which cuBLAS at a few rows does not always).
Everything else (the trainer, the engine's prefill, CPU) keeps F.linear. The model package does not import the kernel;
the caller
hands it in.

In exact mode (the active execution settings' `exact`, settings.py `active_settings`) every product,
of any number of rows, goes through exact.linear instead: one summation order per row
whatever the batch (docs/exact.md); the small-batch hook is not consulted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ouro_cli.settings import active_settings

from . import exact

Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [M, K], w [N, K]) -> [M, N]

_local = threading.local()  # .small: (kernel, max_rows) installed in this thread, or absent


def linear(x: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """x [..., K] @ w[N, K].T -> [..., N]; for a sequence of weights, x @ [w_0; w_1; ...].T ->
    [..., N_0 + N_1 + ...], one product (their gradients flow to each)."""
    if active_settings().exact:
        return exact.linear(x, w)
    w = exact.stacked(w)
    small = getattr(_local, "small", None)
    if small is not None:
        kernel, max_rows = small
        rows = x.numel() // x.shape[-1]
        if rows <= max_rows:
            return kernel(x.reshape(rows, x.shape[-1]).contiguous(), w).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


@contextmanager
def use_small_batch(kernel: Kernel | None, max_rows: int) -> Iterator[None]:
    """Route products of inputs with <= `max_rows` rows to `kernel` inside the block
    (None: no change). Per thread: a trainer thread running beside a decoding engine keeps
    F.linear."""
    previous = getattr(_local, "small", None)
    _local.small = (kernel, max_rows) if kernel is not None else previous
    try:
        yield
    finally:
        _local.small = previous
