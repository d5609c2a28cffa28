"""`compiled`: torch.compile as the model's elementwise math and exact mode's pullbacks use it,
and `compile_seconds`, the compile time a process has spent.

Used by model/pointwise.py (the layer functions and whole layer regions) and by
kernels/exact_rows.py (its backward passes). This module imports nothing else from the
package.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# Each function meets a handful of variants: dtype (fp32/bf16), grad mode (training vs
# rollout), and shapes whose size-1 dims dynamo specialises (decode [B,1,H], prefill
# [1,S,H], training [B,S,H]). dynamo's default of 8 compiled variants per function is
# too few for one process that trains and decodes, and with fullgraph=True running out
# is an error, not a fallback.
RECOMPILE_LIMIT = 64


@functools.cache
def compiled(fn: Callable, dynamic: bool | None = None) -> Callable:
    """`fn` through torch.compile (fullgraph), one compiled function per (fn, dynamic)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False  # see model/pointwise.py `region`
    # dynamic=None (the elementwise functions): the first shape compiles static, a second
    # one a kernel generic in the dims that changed (batch, length), so decode buckets and
    # prompt lengths reuse it; dynamic=True (pointwise's `region`): generic from the start.
    # emulate_precision_casts keeps the roundings the formulas spell out (the normed value
    # is rounded to the activation dtype before the weight multiplies it, docs/model.md §2);
    # without it inductor computes the whole chain in fp32, which is not Ouro's function
    # and differs from the eager path (the CPU tests, the engine's prefill) in bf16.
    import torch._inductor.config as inductor_config  # only when compiling: importing inductor is slow

    options = {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}
    # Mix-order reduction (an RMSNorm backward's row and column sums in one kernel) is chosen,
    # in its strict mode, by size thresholds that become guards of a shape-generic region, so
    # a micro-batch on the other side of a threshold would compile the region again.
    # Non-strict mode fuses wherever the kernel applies, with no guard.
    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        options["triton.mix_order_reduction_non_strict_mode"] = True
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, options=options)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo + inductor, forward and the
    backward compiled at the first backward pass); 0.0 where torch keeps no record."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover
        return 0.0
    return sum(
        sum(compilation_time_metrics.get(key, ())) for key in ("_compile.compile_inner", "backward._backward_impl")
    )
