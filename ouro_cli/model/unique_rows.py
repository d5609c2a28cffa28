"""Gathers and scatters of rows named at most once, forward and backward through gathers only.

A loop that only some positions run (model/ouro.py `_loop_at_rows`) takes their rows out of
the [B·S, ·] activations, runs the layers on them, and writes them back; its attention puts
the queries into a padded [B·W, ·] block and takes the outputs out again
(model/attention.py `sdpa_attention_at_rows`). With `index_select` and `index_copy` those
are scatters in one direction or the other: `index_copy` forward, `index_add` in
`index_select`'s backward. Under the trainer's deterministic algorithms
(trainer/determinism.py) CUDA runs every such scatter as a sort of the indices followed by
the copy, and inductor leaves them to that eager kernel inside the compiled layer regions
(why: docs/performance.md#train).

Every index here names each row at most once, so each scatter is also a gather through the
inverse map (`inverse[i]` = the j with `index[j] = i`, or -1 where no j does): `take` and
`put` run forward and backward as a gather and a select, which inductor fuses and which are
deterministic with any kernel. The values are those of `index_select` and `index_copy`
exactly (pure copies); gradients too: `index_add` of unique indices adds one term to a zero,
which is that term (up to the sign of a zero, which `torch.equal` and every later sum ignore).
"""

from __future__ import annotations

import torch


def inverse_of(index: torch.Tensor, size: int) -> torch.Tensor:
    """[size] long: j at `index[j]`, -1 elsewhere (`index` [N] names each of 0..size-1 at most once)."""
    positions = torch.arange(index.numel(), device=index.device)
    return torch.full((size,), -1, dtype=torch.long, device=index.device).index_copy(0, index, positions)


def take(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`x.index_select(dim, index)` (x has M entries along `dim`, the result N); its gradient is
    spread back to the taken entries by a gather."""
    return _Take.apply(x, index, inverse, dim)


def put(base: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """base [M, ...] with row index[j] replaced by src[j] for every j: `base.index_copy(0, index, src)`,
    forward and backward as gathers."""
    return _Put.apply(base, index, inverse, src)


def _spread(
    values: torch.Tensor, inverse: torch.Tensor, dim: int = 0, otherwise: torch.Tensor | None = None
) -> torch.Tensor:
    """M entries along `dim`: values' entry inverse[i] where inverse[i] >= 0, else otherwise's
    entry i (or zero)."""
    picked = values.index_select(dim, inverse.clamp(min=0))
    return torch.where(
        _hit(inverse, values.dim(), dim), picked, otherwise if otherwise is not None else picked.new_zeros(())
    )


def _hit(inverse: torch.Tensor, ndim: int, dim: int) -> torch.Tensor:
    """inverse >= 0, shaped to broadcast along `dim` of an ndim-dimensional tensor."""
    shape = [1] * ndim
    shape[dim] = -1
    return (inverse >= 0).view(shape)


class _Take(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse, dim):
        ctx.save_for_backward(inverse)
        ctx.dim = dim
        return x.index_select(dim, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _spread(grad, inverse, ctx.dim), None, None, None


class _Put(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base, index, inverse, src):
        ctx.save_for_backward(index, inverse)
        return _spread(src, inverse, 0, base)

    @staticmethod
    def backward(ctx, grad):
        index, inverse = ctx.saved_tensors
        return (
            torch.where(_hit(inverse, grad.dim(), 0), grad.new_zeros(()), grad),
            None,
            None,
            grad.index_select(0, index),
        )
