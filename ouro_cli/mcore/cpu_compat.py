"""Let megatron-core run on a CPU-only process, for CPU training and checkpoint conversion.

megatron-core calls CUDA unconditionally: `torch.cuda.current_device()` for DDP grad
buffers, `torch.cuda.synchronize()` around dist-checkpoint saves, CUDA RNG state in its
RNG tracker, `device="cuda"` factories and `.cuda()` in the optimizers and clipping, and
`param.type() == "torch.cuda.FloatTensor"` checks. Inside `megatron_on_cpu()` those
calls are answered by CPU equivalents:

- `torch.cuda.current_device/synchronize/stream/...` are replaced while the block runs;
- the "CUDA" RNG is a dedicated CPU `torch.Generator` (so the tracker can save and
  restore it without touching the CPU RNG that the rest of the program uses). Megatron's
  tracker sets it through `torch.cuda._lazy_call`, which on a CPU-only build queues the
  call forever, so `megatron.core.tensor_parallel.random`'s get/set helpers are replaced
  too;
- a `TorchFunctionMode` maps `device="cuda[:n]"` (and int device ids) to CPU, makes
  `.cuda()` a no-op and reports CPU float tensor types under their `torch.cuda.*` names.

Scope it to Megatron calls (DDP construction and grad sync, optimizer step, dist
checkpointing): the mode also makes `tensor.is_cuda` answer True. On a process that has
CUDA the context manager does nothing at all unless forced (tested), so GPU runs execute
megatron-core unmodified. Everything patched is recorded and restored on exit.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from .importing import import_megatron_core

_FAKE_CUDA_RNG = torch.Generator()
_lock = threading.RLock()
_depth = 0
_MISSING = object()


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.is_cuda.__get__:
            return True
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _DummyStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _get_rng_state(device="cuda"):
    return _FAKE_CUDA_RNG.get_state()


def _set_rng_state(state, device="cuda"):
    _FAKE_CUDA_RNG.set_state(state)


def _manual_seed(seed):
    _FAKE_CUDA_RNG.manual_seed(int(seed))


def _megatron_get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    return _FAKE_CUDA_RNG.get_state()


def _megatron_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    _FAKE_CUDA_RNG.set_state(new_state)


def _patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) for everything the block replaces."""
    cuda = {
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "current_stream": lambda device=None: _DummyStream(),
        "default_stream": lambda device=None: _DummyStream(),
        "stream": lambda s=None: contextlib.nullcontext(),
        "Stream": _DummyStream,
        "get_rng_state": _get_rng_state,
        "set_rng_state": _set_rng_state,
        "manual_seed": _manual_seed,
        "manual_seed_all": _manual_seed,
        "default_generators": (_FAKE_CUDA_RNG,),
    }
    patches: list[tuple[object, str, object]] = [(torch.cuda, k, v) for k, v in cuda.items()]
    patches += [
        (torch.cuda.random, "get_rng_state", _get_rng_state),
        (torch.cuda.random, "set_rng_state", _set_rng_state),
    ]
    try:
        import_megatron_core()
        mrandom = importlib.import_module("megatron.core.tensor_parallel.random")
    except ImportError:  # megatron-core not installed: nothing of it can run
        mrandom = None
    if mrandom is not None:
        patches += [
            (mrandom, "_get_cuda_rng_state", _megatron_get_cuda_rng_state),
            (mrandom, "_set_cuda_rng_state", _megatron_set_cuda_rng_state),
        ]
    return patches


def fake_cuda_rng() -> torch.Generator:
    """The generator that stands in for the CUDA RNG on CPU (checkpointed as such)."""
    return _FAKE_CUDA_RNG


@contextlib.contextmanager
def megatron_on_cpu(enabled: bool | None = None) -> Iterator[None]:
    """Run the enclosed megatron-core calls on CPU. Inert when CUDA is available.

    Re-entrant: nested uses patch once. `enabled` forces the decision (a CPU trainer on
    a machine with a GPU passes True; tests pass False to check that nothing changes).
    """
    global _depth
    active = (not torch.cuda.is_available()) if enabled is None else enabled
    if not active:
        yield
        return
    saved: list[tuple[object, str, object]] = []
    mode = None
    with _lock:
        _depth += 1
        if _depth == 1:
            for owner, name, value in _patches():
                saved.append((owner, name, getattr(owner, name, _MISSING)))
                setattr(owner, name, value)
            mode = _CudaToCpu()
            mode.__enter__()
    try:
        yield
    finally:
        with _lock:
            if mode is not None:
                mode.__exit__(None, None, None)
                for owner, name, value in reversed(saved):
                    if value is _MISSING:
                        delattr(owner, name)
                    else:
                        setattr(owner, name, value)
            _depth -= 1


def is_patched() -> bool:
    return _depth > 0
