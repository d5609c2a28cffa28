"""The elementwise math of a layer (norms, RoPE, SwiGLU, residual adds), compiled on CUDA.

In eager PyTorch each of these is a chain of small kernels with fp32 intermediates, which
makes decoding launch-bound and training re-read activations. On CUDA the same functions
run through `torch.compile`, which fuses each into one kernel (a residual add and the norm
that follows it into one); weights are arguments, never captured, so one compiled kernel
serves every layer.

CPU (the tests' exact path, fp32/fp64 against independent references) runs the plain
eager functions. Where they compile is an execution setting (ouro_cli/settings.py) of the
model that runs them: `compile="off"` turns compilation off on CUDA too, "always" turns it
on for CPU as well. Where they compile, each whole layer call of the full-sequence forward
(the trainer's replay) compiles as one region (`region`), these functions traced inside it
(`compile_layers`, default "auto"; "off": one compiled call per function): every compiled
call costs host time in guards and wrappers (why: docs/performance.md#train).

The model's entry points (OuroForCausalLM.forward, run_loop) and the engine's decode step
run these functions under their model's settings (settings.py `executing`); outside such a block they
use the defaults, never the environment.
Both the engine and the trainer call these same functions, so on a GPU they stay one
forward pass; the compiled kernels keep eager's intermediate roundings (bf16 results on
CPU are bit-identical to eager).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from ouro_cli.settings import active_settings

from . import compiling, exact, formulas


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`w * (x_wide * rsqrt(mean(x_wide^2) + eps)).to(x.dtype)`, x_wide at least fp32
    (docs/model.md §2)."""
    return _dispatch(formulas.rms_norm, x)(x, weight, eps)


def rms_norm_generic(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm`, compiled shape-generic like `region` (the replay's norm before its first layer)."""
    return _dispatch(formulas.rms_norm, x, dynamic=True if active_settings().layer_regions else None)(x, weight, eps)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h + rms_norm(x)`: a sandwich norm closing a sublayer into the residual stream."""
    return _dispatch(formulas.add_rms_norm, x)(h, x, weight, eps)


def add_rms_norm_then_norm(
    h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`h' = h + rms_norm(x, weight)`, `rms_norm(h', next_weight)`): the attention block's close and the
    MLP's input norm in one pass."""
    return _dispatch(formulas.add_rms_norm_then_norm, x)(h, x, weight, next_weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (rotate-half) on q [B,S,Hq,D] and k [B,S,Hkv,D]; cos/sin [B,S,D]."""
    return _dispatch(formulas.rotary, q)(q, k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _dispatch(formulas.silu_mul, gate)(gate, up)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last axis: the logprobs the engine samples from and the trainer
    scores (docs/model.md §4) go through this one function (in exact mode exact.log_softmax)."""
    if active_settings().exact:
        return exact.log_softmax(x)
    return torch.log_softmax(x, dim=-1)


_local = threading.local()  # .eager: inside `eager()`


def region(fn: Callable, x: torch.Tensor) -> Callable:
    """`fn` (one layer call) compiled as one region where these functions compile and the
    active settings' `compile_layers` says so, else itself. Inside the region the functions
    above are traced inline, not called compiled (`_dispatch` sees the compilation).

    The region is compiled shape-generic from its first call (`dynamic=True`): the trainer's
    micro-batches change their rows and row width every update, and a specialised first
    compile would be followed by a second, generic one at the next new shape. Parameter
    shapes stay static (dynamo's default), so only the token dimensions are symbolic, and duck
    sizing is off: a token dimension that happens to equal a head count or head size at the
    first call would otherwise be fused with it and specialised."""
    return _dispatch(fn, x, dynamic=True) if active_settings().layer_regions else fn


def regions_compile(device_type: str) -> bool:
    """Whether a full-sequence forward on `device_type` runs its layer calls as compiled regions
    (`region`) under the active settings, outside an `eager()` block."""
    settings = active_settings()
    return settings.layer_regions and settings.compiles(device_type) and not getattr(_local, "eager", False)


def fused(fn: Callable, x: torch.Tensor) -> Callable:
    """`fn` (a function of tensors, elementwise work only) as these functions run: compiled
    into fused kernels where x's device compiles (CUDA, unless the settings say otherwise), else itself.
    For elementwise bookkeeping outside the layers (the engine's exit state)."""
    return _dispatch(fn, x)


# ---- dispatch -----------------------------------------------------------------------


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run the plain functions inside this block, on any device.

    A compiled call costs more host time (guards, wrappers) than a few eager kernel
    launches. That pays off where the GPU work is large (training) or the host cost is paid
    once (CUDA-graph capture), not in the engine's host-bound prefill
    (why: docs/performance.md#whole-update)."""
    before = getattr(_local, "eager", False)
    _local.eager = True
    try:
        yield
    finally:
        _local.eager = before


def _dispatch(fn: Callable, x: torch.Tensor, dynamic: bool | None = None) -> Callable:
    if active_settings().exact:  # its batch-invariant twin, eager (model/exact.py)
        return _EXACT.get(fn, fn)
    if torch.compiler.is_compiling() or getattr(_local, "eager", False):
        return fn  # traced into an enclosing region, or asked to stay eager
    if active_settings().compiles(x.device.type):
        return compiling.compiled(fn, dynamic)
    return fn


# exact mode's twins of the functions above (RoPE's is one kernel per tensor where exact mode
# runs its kernels, and the plain formula elsewhere: elementwise arithmetic is batch-invariant
# as it is; so are the residual adds).
_EXACT: dict[Callable, Callable] = {
    formulas.rms_norm: exact.rms_norm,
    formulas.add_rms_norm: exact.add_rms_norm,
    formulas.add_rms_norm_then_norm: exact.add_rms_norm_then_norm,
    formulas.silu_mul: exact.silu_mul,
    formulas.rotary: exact.rotary,
}
