"""Every random number generator a resumed run must continue exactly.

Python's `random`, NumPy's global generator, torch's CPU generator, the CUDA generator
(on a CPU process: the stand-in generator of `ouro_cli.mcore.cpu_compat`, which is what
Megatron's RNG tracker drives there) and the named states of Megatron's RNG tracker.
States are plain tensors / tuples of ints so a checkpoint loads with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ouro_cli.mcore.cpu_compat import fake_cuda_rng


def _cuda_generator_state(on_cuda: bool) -> torch.Tensor:
    return torch.cuda.get_rng_state() if on_cuda else fake_cuda_rng().get_state()


def capture(on_cuda: bool) -> dict:
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch_cpu": torch.get_rng_state(),
        "cuda": _cuda_generator_state(on_cuda),
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def restore(state: dict, on_cuda: bool) -> None:
    from megatron.core import tensor_parallel

    random.setstate(_as_python_state(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch_cpu"])
    if on_cuda:
        torch.cuda.set_rng_state(state["cuda"])
    else:
        fake_cuda_rng().set_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _as_python_state(value):
    """random.setstate wants tuples; a checkpoint round trip may hand back lists."""
    version, internal, gauss = value
    return (version, tuple(internal), gauss)
