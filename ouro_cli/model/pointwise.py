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
run these functions under their model's settings (`executing`); outside such a block they
use the defaults, never the environment.
Both the engine and the trainer call these same functions, so on a GPU they stay one
forward pass; the compiled kernels keep eager's intermediate roundings (bf16 results on
CPU are bit-identical to eager).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ouro_cli.settings import ExecutionSettings

from . import exact

DEFAULTS = ExecutionSettings()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`w * (x_wide * rsqrt(mean(x_wide^2) + eps)).to(x.dtype)`, x_wide at least fp32
    (docs/model.md §2)."""
    return _dispatch(_rms_norm, x)(x, weight, eps)


def rms_norm_generic(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm`, compiled shape-generic like `region` (the replay's norm before its first layer)."""
    return _dispatch(_rms_norm, x, dynamic=True if active().layer_regions else None)(x, weight, eps)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h + rms_norm(x)`: a sandwich norm closing a sublayer into the residual stream."""
    return _dispatch(_add_rms_norm, x)(h, x, weight, eps)


def add_rms_norm_then_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`h' = h + rms_norm(x, weight)`, `rms_norm(h', next_weight)`): the attention block's close and the
    MLP's input norm in one pass."""
    return _dispatch(_add_rms_norm_then_norm, x)(h, x, weight, next_weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (rotate-half) on q [B,S,Hq,D] and k [B,S,Hkv,D]; cos/sin [B,S,D]."""
    return _dispatch(_rotary, q)(q, k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _dispatch(_silu_mul, gate)(gate, up)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last axis: the logprobs the engine samples from and the trainer
    scores (docs/model.md §4) go through this one function (in exact mode exact.log_softmax)."""
    if active().exact:
        return exact.log_softmax(x)
    return torch.log_softmax(x, dim=-1)


_local = threading.local()  # .settings: the active ExecutionSettings; .eager: inside `eager()`


@contextlib.contextmanager
def _in_this_thread(name: str, value) -> Iterator[None]:
    before = getattr(_local, name, None)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, before)


def executing(settings: ExecutionSettings) -> contextlib.AbstractContextManager[None]:
    """Run these functions under `settings` inside the block (per thread)."""
    return _in_this_thread("settings", settings)


def active() -> ExecutionSettings:
    """The settings of the block this thread runs in (`executing`), else the defaults."""
    return getattr(_local, "settings", None) or DEFAULTS


def under(fn: Callable, settings: ExecutionSettings) -> Callable:
    """`fn` that runs under `settings` whenever it is called: for a function called again
    outside the block that made it (activation recompute re-runs a layer call in backward)."""
    def run(*args):
        with executing(settings):
            return fn(*args)

    return run


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
    return _dispatch(fn, x, dynamic=True) if active().layer_regions else fn


def regions_compile(device_type: str) -> bool:
    """Whether a full-sequence forward on `device_type` runs its layer calls as compiled regions
    (`region`) under the active settings, outside an `eager()` block."""
    settings = active()
    return settings.layer_regions and settings.compiles(device_type) and not getattr(_local, "eager", False)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo + inductor, forward and the
    backward compiled at the first backward pass); 0.0 where torch keeps no record."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover
        return 0.0
    return sum(sum(compilation_time_metrics.get(key, ())) for key in ("_compile.compile_inner",
                                                                         "backward._backward_impl"))


def fused(fn: Callable, x: torch.Tensor) -> Callable:
    """`fn` (a function of tensors, elementwise work only) as these functions run: compiled
    into fused kernels where x's device compiles (CUDA, unless the settings say otherwise), else itself.
    For elementwise bookkeeping outside the layers (the engine's exit state)."""
    return _dispatch(fn, x)


# ---- the math, once ---------------------------------------------------------------

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # At least fp32 (fp64 stays fp64, which lets tests compare against an fp64 reference).
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return h + _rms_norm(x, weight, eps)


def _add_rms_norm_then_norm(h, x, weight, next_weight, eps):
    h = h + _rms_norm(x, weight, eps)
    return h, _rms_norm(h, next_weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# ---- dispatch -----------------------------------------------------------------------

def eager() -> contextlib.AbstractContextManager[None]:
    """Run the plain functions inside this block, on any device.

    A compiled call costs more host time (guards, wrappers) than a few eager kernel
    launches. That pays off where the GPU work is large (training) or the host cost is paid
    once (CUDA-graph capture), not in the engine's host-bound prefill
    (why: docs/performance.md#whole-update)."""
    return _in_this_thread("eager", True)


def _dispatch(fn: Callable, x: torch.Tensor, dynamic: bool | None = None) -> Callable:
    if active().exact:  # its batch-invariant twin, eager (model/exact.py)
        return _EXACT.get(fn, fn)
    if torch.compiler.is_compiling() or getattr(_local, "eager", False):
        return fn  # traced into an enclosing region, or asked to stay eager
    if active().compiles(x.device.type):
        return _compiled(fn, dynamic)
    return fn


# exact mode's twins of the functions above (RoPE's is one kernel per tensor where exact mode
# runs its kernels, and the plain formula elsewhere: elementwise arithmetic is batch-invariant
# as it is; so are the residual adds).
_EXACT: dict[Callable, Callable] = {_rms_norm: exact.rms_norm, _add_rms_norm: exact.add_rms_norm,
                                    _add_rms_norm_then_norm: exact.add_rms_norm_then_norm, _silu_mul: exact.silu_mul,
                                    _rotary: exact.rotary}


# Each function meets a handful of variants: dtype (fp32/bf16), grad mode (training vs
# rollout), and shapes whose size-1 dims dynamo specialises (decode [B,1,H], prefill
# [1,S,H], training [B,S,H]). dynamo's default of 8 compiled variants per function is
# too few for one process that trains and decodes, and with fullgraph=True running out
# is an error, not a fallback.
RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(fn: Callable, dynamic: bool | None = None) -> Callable:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False  # see `region`
    # dynamic=None (the elementwise functions): the first shape compiles static, a second
    # one a kernel generic in the dims that changed (batch, length), so decode buckets and
    # prompt lengths reuse it; dynamic=True (`region`): generic from the start.
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
