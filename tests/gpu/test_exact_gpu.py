"""Exact mode on CUDA (docs/exact.md; skipped without a GPU or triton).

- The fixed-tile linear kernel at the Ouro-1.4B shapes: within 1 ulp of fp64 rounded to
  bf16, and a row's bits the same alone, among 8 to 8,192 rows (across every tile config's
  row limit) and reversed, and under every tile config; the
  CPU checks (tests/unit/engine/_fixed_tile_checks.py) compiled, fp32 and bf16.
- The row functions (norm, log-softmax over 49,152 logits, the gate) give a row the same
  bits in a batch of 1 and of 4,096; their Triton kernels (kernels/exact_rows.py) pass the CPU
  interpreter's checks compiled, and at the 1.4B widths; RoPE's kernel equals the eager
  formula bit for bit (the GPU's casts round to nearest, as torch's do).
- Exact mode's gradients on CUDA (stacked projections, the row kernels' pullbacks, the paged
  replay attention with SDPA's backward) are the default mode's within fp32 rounding.
- End to end on a tiny model, bf16 and fp32, CUDA graphs on: every logprob the engine reports
  equals the replay to the bit, with threshold exits at mixed depths, and a request's outputs
  do not depend on its batch-mates; with an fp8 KV cache too (bf16, graphs off).

bench/exact.py runs the same agreement at the 1.4B shape (K = 2/3/4, τ = 0.7, batches 1-128).
"""

from __future__ import annotations

import pytest
import torch

from ouro_cli.model import exact, pointwise
from ouro_cli.settings import ExecutionSettings, executing
from tests.unit.engine._fixed_tile_checks import (
    check_bad_input,
    check_batch_invariance,
    check_configs,
    check_exact_engine,
    check_fused_columns,
    check_reference,
)
from tests.unit.engine._gemv_kernel_checks import operands

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

SHAPES = {
    "q_proj": (2048, 2048),
    "k_proj": (2048, 2048),
    "gate": (5632, 2048),
    "down": (2048, 5632),
    "lm_head": (49152, 2048),
    "exit_gate": (1, 2048),
}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
EXACT = ExecutionSettings(exact=True)


@pytest.mark.parametrize("name", SHAPES)
def test_fixed_tile_1p4b_shapes(name):
    n, k = SHAPES[name]
    check_reference("cuda", torch.bfloat16, shapes=[(n, k)], rows=[1, 8, 65])
    check_batch_invariance("cuda", torch.bfloat16, shapes=[(n, k)], rows=(8, 64, 65, 200))
    from ouro_cli.kernels.fixed_tile import fixed_tile_linear

    x, w = operands(8192, n, k, torch.bfloat16, "cuda")
    big = fixed_tile_linear(x, w)
    for m in (1, 8, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025):  # both sides of each row limit (CONFIGS)
        assert torch.equal(fixed_tile_linear(x[-m:].contiguous(), w), big[-m:]), f"{name}: rows changed at M={m}"
    check_configs("cuda", torch.bfloat16, shapes=[(n, k)], rows=(8, 256, 600))


def test_fused_projections_keep_each_parts_bits():
    """The engine's [q;k;v] and [gate;up] (model/fusion.py, on in exact mode too) at the 1.4B
    shapes: each part's columns have the bits of that part's own product (the trainer's)."""
    for parts in (((2048, 2048),) * 3, ((5632, 2048),) * 2):
        check_fused_columns("cuda", torch.bfloat16, parts=parts, rows=(8, 256, 4096))


@DTYPES
def test_fixed_tile_small_shapes(dtype):
    check_reference("cuda", dtype)
    check_batch_invariance("cuda", dtype)
    check_bad_input("cuda")


def test_row_functions_are_batch_invariant_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
    w = torch.randn(2048, device="cuda", generator=g).bfloat16()
    logits = 5 * torch.randn(512, 49152, device="cuda", generator=g)
    gate_w = torch.randn(1, 2048, device="cuda", generator=g).bfloat16() / 45
    gate_b = torch.zeros(1, device="cuda").bfloat16()
    for fn, x in (
        (lambda t: exact.rms_norm(t, w, 1e-6), h),
        (exact.log_softmax, logits),
        (lambda t: exact.exit_lambda(t, gate_w, gate_b), h),
        (lambda t: exact.silu_mul(t, t), h),
    ):
        full = fn(x)
        for rows in (slice(0, 1), slice(5, 13), slice(100, 164)):
            assert torch.equal(fn(x[rows]), full[rows])


@DTYPES
def test_row_kernels_at_1p4b_widths(dtype):
    """kernels/exact_rows.py compiled: the interpreter checks, then at the hidden, MLP and vocabulary
    widths of 1.4B, with a batch of 4,096 rows."""
    from tests.unit.engine import _exact_rows_checks as rows

    rows.check_reference("cuda", dtype)
    rows.check_batch_invariance("cuda", dtype)
    rows.check_gradients("cuda", dtype)
    rows.check_reference("cuda", dtype, widths=[2048, 5632], vocabs=[49152])
    rows.check_batch_invariance("cuda", dtype, width=2048, vocab=49152, rows=(1, 8, 65, 4096))
    rows.check_rotary("cuda", dtype)
    rows.check_rotary("cuda", dtype, heads=(16, 16), head_dim=128, positions=(8, 512))  # 1.4B's heads


def _generate(model, max_num_seqs):
    from ouro_cli.engine import LLM, SamplingParams
    from tests.unit.engine.conftest import prompts

    llm = LLM(model, max_num_seqs=max_num_seqs, kv_blocks=64, block_size=4, execution=EXACT)
    params = [
        SamplingParams(max_tokens=14, temperature=1.0, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True)
        for s in range(6)
    ]
    try:
        return llm.generate(prompts(6, seed=1), params)
    finally:
        llm.close()


def test_gradients_are_the_default_modes_within_fp32_rounding_on_cuda():
    from tests.unit.model.test_exact import check_gradients_near_the_default

    check_gradients_near_the_default("cuda")


@DTYPES
def test_engine_logprobs_are_the_replay_to_the_bit_on_cuda(dtype):
    from tests.unit.engine.conftest import tiny_model

    model = tiny_model(0).to("cuda", dtype)
    outs = _generate(model, 4)
    assert len({d for o in outs for d in o.exit_depths[1:]}) >= 3
    for out in outs:
        m, r = len(out.prompt_token_ids), out.output_token_ids
        ids = torch.tensor([out.prompt_token_ids + r], device="cuda")
        depths = torch.tensor([[4] * m + out.exit_depths[1:] + [4]], device="cuda")
        with torch.no_grad(), executing(EXACT):
            logp = pointwise.log_softmax(model(ids, depths=depths)[0].float())
        ref = logp[m - 1 : m - 1 + len(r)].gather(1, torch.tensor(r, device="cuda")[:, None]).squeeze(1).cpu()
        assert torch.equal(torch.tensor(out.log_probs, dtype=torch.float64), ref.double())
    alone = _generate(model, 1)
    for a, b in zip(outs, alone, strict=True):
        assert (a.output_token_ids, a.exit_depths, a.log_probs) == (b.output_token_ids, b.exit_depths, b.log_probs)


def test_engine_logprobs_with_an_fp8_cache_are_the_replay_to_the_bit_on_cuda():
    """Exact mode's CUDA path with an fp8 KV cache: the decode kernel reads the packed rows, the
    replay's kernel the K/V its layers rounded; the same bits (bf16)."""
    check_exact_engine("cuda", torch.bfloat16, kv_cache_dtype="fp8")


def test_prefill_graphs_of_several_widths_stay_valid_across_forwards():
    """Exact mode with CUDA graphs: fresh prompts in four prefill buckets (a captured graph each),
    a trainer-sized replay and junk in the freed memory between two rollouts; both rollouts
    equal the graph-free engine's bit for bit. (A captured prefill once read the slot table its
    warm-up had left in a module cache; once freed and reused, its replay read junk slots: an
    illegal address at real prompt lengths.)"""
    from ouro_cli.engine import LLM, SamplingParams
    from tests.unit.engine.conftest import tiny_model

    model = tiny_model(0).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    lengths = [5, 20, 40, 100, 200, 30, 90]
    batch = [torch.randint(1, 96, (n,), generator=g).tolist() for n in lengths]
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True)
        for s in range(len(batch))
    ]

    def rollouts(graphs: bool) -> list[tuple]:
        llm = LLM(model, max_num_seqs=8, kv_blocks=256, block_size=16, execution=EXACT, cuda_graphs=graphs)
        try:
            first = llm.generate(batch, params)
            with torch.no_grad(), executing(EXACT):  # a replay between rollouts, as the trainer's
                model(torch.randint(1, 96, (4, 300), device="cuda"))
            junk = torch.full((2**26,), 2**40, dtype=torch.long, device="cuda")  # reuses what was freed
            del junk
            second = llm.generate(batch, params)
        finally:
            llm.close()
        return [[(o.output_token_ids, o.exit_depths, o.log_probs) for o in outs] for outs in (first, second)]

    eager = rollouts(False)
    assert eager[0] == eager[1]
    assert rollouts(True) == eager
