"""Triton kernels: the engine's decode step on CUDA, and the model's paged replay attention.

The torch code they replace (engine/paged_attention.py, the KV writes in engine/runner.py,
model/kv_quant.py's round trip, F.linear) stays the reference and the CPU path; on CUDA a
decode step is otherwise bound by the launches of its many small torch kernels. Which path
runs is an execution setting (ouro_cli/settings.py: `--decode-attention`, `--decode-gemv`,
`--replay-attention`; the fp8 round trip's: the device, kv_quant.py); this package holds the
kernels, shared by the engine and the model so that neither imports the other:

- `decode_attention.py`: one decode layer-loop's KV write and attention over the paged plane;
  with the cascade, a prefix that rows share (a GRPO group's prompt) read once for all of them.
- `gemv.py`: a small-batch matmul for the decode step's projections. `--decode-gemv auto`
  (the default) runs it on the shapes where bench/gemv.py finds it faster than cuBLAS
  (up to 16 rows on qkv, o_proj and down), F.linear elsewhere; "triton" on every product
  of up to 64 rows; "cublas" never (why: docs/performance.md#decode).
- `fp8_rows.py`: the fp8 KV format's rounding (model/kv_quant.py) with the torch code's bits, in
  integer arithmetic: a layer's K/V round trip in one kernel, and the packed rows the decode
  kernel writes.
- `replay_attention.py`: the whole-sequence forward's attention through the decode kernel,
  each query in the decode step's order, up to 16 queries of a run sharing a program's K/V
  reads (`--replay-attention paged`, and exact mode's attention on CUDA).
- `fixed_tile.py` and `exact_rows.py`: exact mode's projections and row functions (norms,
  silu·up, log-softmax), each with one summation order for any number of rows (`--exact`,
  model/exact.py).

Importing this package does not import triton. Off CUDA the kernels run only under the
Triton interpreter (TRITON_INTERPRET=1, which the CPU tests use).
"""

from __future__ import annotations

from ouro_cli import env


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def checks_enabled() -> bool:
    """Whether the kernels check the indices they dereference before each launch
    (`OURO_CHECK_KERNELS=1`, kernels/bounds.py): a debugging aid that reads the device."""
    return env.get("OURO_CHECK_KERNELS")


def interpreted() -> bool:
    """Whether Triton kernels run under its CPU interpreter (Triton's own TRITON_INTERPRET)."""
    return env.get("TRITON_INTERPRET")
