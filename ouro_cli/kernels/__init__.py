"""Triton kernels for the engine's decode step on CUDA.

The torch code next door (paged_attention.py, the KV writes in runner.py) stays the
reference and the CPU path; these kernels replace it on CUDA, where a decode step is
otherwise bound by the launches of ~40 small torch kernels per layer and loop.
`decode_attention.py` holds them; this module only decides whether they are used, so
that importing the engine never needs triton.

`attention` is "torch", "triton" or "auto" (triton on CUDA when it imports); None reads
OURO_DECODE_ATTENTION (default "auto"). "triton" off CUDA runs only under the Triton
interpreter (TRITON_INTERPRET=1), which the CPU tests use.

`gemv.py` holds a small-batch matmul for the decode step's projections. OURO_DECODE_GEMV:
"auto" (default) runs it where bench/gemv.py measured it faster than cuBLAS on the H200 (up
to 16 rows on qkv, o_proj and down, with the tiles the sweep chose: x1.03-1.10), F.linear
elsewhere; "triton" on every product of up to 64 rows; "cublas" never. End to end (1.4B,
K = 4, bench/gpu_table.py) "auto" took batch 1 from 164.7 to 173.6 tok/s and batch 16 from
2,434 to 2,579. Its rows had the bits cuBLAS gives at the replay's many rows on every 1.4B
shape (same weights; measured with its earlier tiles, and its order of summation does not
depend on the tiles), which cuBLAS at 8 rows does not for down_proj (it splits K); the
engine-vs-trainer bf16 agreement did not change measurably with it (0.046 both ways with
"triton"; 0.0452 with "auto").
"""

from __future__ import annotations

import os

import torch

from ouro_cli.errors import SettingError

ATTENTION_MODES = ("auto", "torch", "triton")
GEMV_MODES = ("auto", "cublas", "triton")
DEFAULT_GEMV = "auto"


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
        raise SettingError(f"decode attention (OURO_DECODE_ATTENTION) must be one of {', '.join(ATTENTION_MODES)}, "
                           f"got {mode!r}")
    if mode == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if mode == "triton" and not triton_available():
        raise SettingError("decode attention 'triton' needs the triton package (pip install triton)")
    return mode


def resolve_gemv(mode: str | None, device: torch.device):
    """The decode step's small-batch matmul kernel on `device` (kernels/gemv.py), or
    None for F.linear (cuBLAS on CUDA). "auto": the kernel on the shapes where it was
    measured faster, on CUDA with triton; "triton": on every product of <= 64 rows."""
    mode = mode or os.environ.get("OURO_DECODE_GEMV", DEFAULT_GEMV)
    if mode not in GEMV_MODES:
        raise SettingError(f"decode GEMV (OURO_DECODE_GEMV) must be one of {', '.join(GEMV_MODES)}, got {mode!r}")
    if mode == "cublas" or (mode == "auto" and (device.type != "cuda" or not triton_available())):
        return None
    if not triton_available():
        raise SettingError("decode GEMV 'triton' needs the triton package (pip install triton)")
    from .gemv import small_m_linear, small_m_linear_where_faster
    return small_m_linear if mode == "triton" else small_m_linear_where_faster


def check_settings(device: torch.device) -> None:
    """The OURO_* kernel switches, read where they are used, checked up front for a run on
    `device`: a bad value is one SettingError before any model loads, not a failure midway."""
    from ouro_cli.model.attention import PAGED_NEEDS_CUDA, replay_attention_mode
    from ouro_cli.model.pointwise import compile_layers

    compile_layers()  # OURO_COMPILE_LAYERS: auto, 0 or 1
    no_kernel_device = device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    attention = resolve_attention(None, device)
    if attention == "triton" and no_kernel_device:
        raise SettingError("OURO_DECODE_ATTENTION=triton needs CUDA (or the Triton interpreter, TRITON_INTERPRET=1)")
    if resolve_gemv(None, device) is not None and no_kernel_device:
        raise SettingError("OURO_DECODE_GEMV=triton needs CUDA (or the Triton interpreter, TRITON_INTERPRET=1)")
    if replay_attention_mode() == "paged" and no_kernel_device:
        raise SettingError(PAGED_NEEDS_CUDA)
