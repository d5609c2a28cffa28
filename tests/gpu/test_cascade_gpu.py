"""The cascade (shared-prefix) decode attention on CUDA (skipped without a GPU or triton): the
checks of tests/unit/engine/_cascade_checks.py, compiled, at Ouro-1.4B's attention shape
(16 heads of 128, the 64-position tile), so the prefix pass and the decode kernel run the
tensor-core dots whose bits must agree.

- With and without the cascade the kernel gives the same bits: bf16, fp32 and packed fp8 rows;
  MHA (G = 1, 16 rows a prefix program) and G = 2; groups of 8 on prompts of 100 and 1,000
  tokens with responses up to 256, beside lone rows and a group of 17 (two programs).
- The fused KV write and attention, captured in a CUDA graph with empty tables and replayed
  after the plan is copied in, gives the eager kernel's planes and output without the cascade.
- The tiny model's engine under CUDA graphs gives the same tokens, depths and logprobs with the
  cascade on and off; in exact mode (bf16), with the cascade on, it reports the replay's
  logprobs to the bit.

    pytest -q -m gpu tests/gpu/test_cascade_gpu.py
"""

from __future__ import annotations

import pytest

from tests.unit.engine._cascade_checks import check_bits, check_engine, check_exact_engine, check_graph_capture

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

RESPONSES = [1, 17, 64, 100, 129, 200, 255, 256]  # a group of 8 at positions up to ~256 past its prompt
CASES = [
    (1, 16, 64, [(100, RESPONSES), (1000, RESPONSES), (130, [1]), (64, [3] * 17), (1000, [40])]),
    (2, 16, 64, [(1000, RESPONSES), (100, RESPONSES), (5, [2])]),
]


@pytest.mark.parametrize("g", [1, 2], ids=["mha", "gqa2"])
def test_cascade_keeps_the_bits_at_the_1_4b_shape(g):
    check_bits("cuda", hkv=16 // g, d=128, cases=[c for c in CASES if c[0] == g])


def test_cascade_step_captured_in_a_cuda_graph_keeps_the_bits():
    check_graph_capture("cuda")


def test_engine_with_cascade_on_and_off_under_graphs():
    check_engine("cuda")


def test_exact_mode_with_cascade_reports_the_replay_bits():
    check_exact_engine("cuda")
