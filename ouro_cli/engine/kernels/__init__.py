"""Triton kernels for the engine's decode step on CUDA.

The torch code next door (paged_attention.py, the KV writes in runner.py) stays the
reference and the CPU path; these kernels replace it on CUDA, where a decode step is
otherwise bound by the launches of ~40 small torch kernels per layer and loop.
`decode_attention.py` holds them; this module only decides whether they are used, so
that importing the engine never needs triton.

`attention` is "torch", "triton" or "auto" (triton on CUDA when it imports); None reads
OURO_DECODE_ATTENTION (default "auto"). "triton" off CUDA runs only under the Triton
interpreter (TRITON_INTERPRET=1), which the CPU tests use.
"""

from __future__ import annotations

import os

import torch

ATTENTION_MODES = ("auto", "torch", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention(attention: str | None, device: torch.device) -> str:
    """The decode attention path to use on `device`: "torch" or "triton"."""
    mode = attention or os.environ.get("OURO_DECODE_ATTENTION", "auto")
    if mode not in ATTENTION_MODES:
        raise ValueError(f"decode attention must be one of {', '.join(ATTENTION_MODES)}, got {mode!r}")
    if mode == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if mode == "triton" and not triton_available():
        raise RuntimeError("decode attention 'triton' needs the triton package (pip install triton)")
    return mode
