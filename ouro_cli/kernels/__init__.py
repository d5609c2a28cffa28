"""Triton kernels: the engine's decode step on CUDA, and the model's paged replay attention.

The torch code they replace (engine/paged_attention.py, the KV writes in engine/runner.py,
F.linear) stays the reference and the CPU path; on CUDA a decode step is otherwise bound
by the launches of ~40 small torch kernels per layer and loop. Which path runs is an
execution setting (ouro_cli/settings.py: `--decode-attention`, `--decode-gemv`,
`--replay-attention`); this package holds the kernels, shared by the engine and the model
so that neither imports the other:

- `decode_attention.py`: one decode layer-loop's KV write and attention over the paged plane.
- `gemv.py`: a small-batch matmul for the decode step's projections. `--decode-gemv auto`
  (the default) runs it where bench/gemv.py measured it faster than cuBLAS on the H200 (up
  to 16 rows on qkv, o_proj and down, with the tiles the sweep chose: x1.03-1.10), F.linear
  elsewhere; "triton" on every product of up to 64 rows; "cublas" never. End to end (1.4B,
  K = 4, bench/gpu_table.py) "auto" took batch 1 from 164.7 to 173.6 tok/s and batch 16
  from 2,434 to 2,579. Its rows had the bits cuBLAS gives at the replay's many rows on every
  1.4B shape (same weights; measured with its earlier tiles, and its order of summation does
  not depend on the tiles), which cuBLAS at 8 rows does not for down_proj (it splits K); the
  engine-vs-trainer bf16 agreement did not change measurably with it (0.046 both ways with
  "triton"; 0.0452 with "auto").
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
