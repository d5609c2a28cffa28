"""The Triton decode kernels on CUDA (skipped without a GPU or triton).

Kernel level (the checks of tests/unit/engine/_decode_kernel_checks.py, compiled this
time): attention equals the torch reference (paged_attention.decode_attention) and a
dense fp64 one to 1e-5 in fp32 and to 2e-2 absolute in bf16 (outputs are O(1); bf16
has 8 bits of mantissa and P is rounded to bf16 for P·V); a row's output is bitwise the
same alone or among longer rows; the KV write fused into the attention kernel equals the
torch write exactly, and its output the attention kernel's over the written planes (over an
fp8 cache too: packed rows with kv_quant.pack's bytes, exited rows' rows copied); over an fp8
cache's packed rows the kernel gives the bits it gives over the rows unpacked, and the replay
each query's decode bits over the engine's packed rows at Ouro's head shape (and the kernels'
conversion of codes gives torch's values for every finite code); the fp8 round trip's kernel
(kernels/fp8_rows.py) has the torch round trip's bits, on CUDA and on the CPU, at a decode
step's shape (4,096 tokens x 8 KV heads x 128).

Engine level, on the tiny model: attention="triton" under CUDA graphs gives the eager
results bit for bit; in fp32 it reports the torch path's tokens, depths and logprobs
(to 1e-5) and equals the trainer's replay (to 1e-5); in bf16, at a fixed depth, the
logprobs of the tokens both paths agree on stay within 5e-2 of the torch path's.
Overlapped decoding gives the outputs of stepping one at a time, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from ouro_cli.engine import LLM, SamplingParams
from ouro_cli.settings import ExecutionSettings
from tests.unit.engine._decode_kernel_checks import (
    check_attention,
    check_batch_invariance,
    check_e4m3_values,
    check_fp8_attention,
    check_fp8_replay,
    check_fp8_round_trip,
    check_fp8_twice_the_codes,
    check_replay_attention,
    check_width_from_reach,
    check_write_and_attend,
    paged_context,
)
from tests.unit.engine.conftest import prompts, tiny_model
from tests.unit.engine.test_replay import max_replay_error

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
PARAMS = [
    SamplingParams(max_tokens=12, seed=s, logprobs=0, exit_threshold=0.5, exit_mode=m, ignore_eos=True)
    for s, m in enumerate(["immediate", "delayed", "immediate", "delayed", "immediate"])
]


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@DTYPES
def test_attention_matches_reference(dtype):
    check_attention("cuda", dtype, TOL[dtype])


def test_e4m3_codes_become_their_values():
    check_e4m3_values("cuda")


def test_fp8_rows_are_read_as_their_unpacked_values():
    check_fp8_attention("cuda")


def test_fp8_rows_as_twice_the_codes_keep_the_bits():
    check_fp8_twice_the_codes("cuda")


def test_fp8_register_cap_keeps_the_bits(monkeypatch):
    """The fp8 kernel's launch under its register cap (decode_attention.FP8_MAXNREG) gives the
    bits of the compiler's own launch, at Ouro-1.4B's heads (16 of 128) over packed rows."""
    from ouro_cli.kernels import decode_attention as kernels
    from ouro_cli.model import kv_quant

    assert kernels.launch_options(2, cuda=True) == {"maxnreg": kernels.FP8_MAXNREG}
    lengths = [300, 257, 1, 64, 129, 200, 31, 300]
    k_plane, v_plane, ctx, _, lens = paged_context(len(lengths), 16, 128, lengths, 320, torch.float32, "cpu", seed=3)
    packed = [kv_quant.torch_pack(x).cuda() for x in (k_plane, v_plane)]
    q = torch.randn(len(lengths), 16, 128, generator=torch.Generator().manual_seed(4)).cuda().bfloat16()
    capped = kernels.paged_decode_attention(q, *packed, ctx.cuda(), lens.cuda())
    monkeypatch.setattr(kernels, "FP8_MAXNREG", None)
    assert torch.equal(capped, kernels.paged_decode_attention(q, *packed, ctx.cuda(), lens.cuda()))


def test_fp8_replay_gives_each_query_the_decode_kernels_bits():
    """At Ouro-1.4B's heads (16 of 128, G = 1) and 300 positions a row."""
    check_fp8_replay("cuda", s=300, heads=16)


@DTYPES
def test_attention_is_batch_invariant(dtype):
    check_batch_invariance("cuda", dtype)


@DTYPES
def test_replay_attention_in_decode_order(dtype):
    check_replay_attention("cuda", dtype, TOL[dtype])


@DTYPES
def test_write_and_attend_matches_the_two_steps(dtype):
    check_write_and_attend("cuda", dtype)


@DTYPES
def test_fp8_write_and_attend_matches_the_two_steps(dtype):
    check_write_and_attend("cuda", dtype, fp8=True)


def test_fp8_round_trip_kernel_has_the_torch_bits_at_a_decode_shape():
    check_fp8_round_trip("cuda", shape=(4096, 8, 128), dtypes=(torch.bfloat16, torch.float32, torch.float16))


def _generate(model, monkeypatch, attention, graphs, n=4, dtype=None, params=PARAMS):
    llm = LLM(
        model,
        device="cuda",
        dtype=dtype,
        max_num_seqs=n,
        kv_blocks=64,
        block_size=4,
        cuda_graphs=graphs,
        execution=ExecutionSettings(decode_attention=attention),
    )
    try:
        assert llm.runner.attention == attention
        return llm.generate(prompts(5, seed=1), params)
    finally:
        llm.close()


def _assert_identical(a_outs, b_outs):
    for a, b in zip(a_outs, b_outs, strict=True):
        assert a.output_token_ids == b.output_token_ids and a.exit_depths == b.exit_depths
        assert a.log_probs == b.log_probs


def test_engine_fp32_triton_graphs_equal_eager_and_torch_and_replay(monkeypatch):
    model = tiny_model(0).cuda()
    eager = _generate(model, monkeypatch, "triton", graphs=False)
    assert len({d for o in eager for d in o.exit_depths[1:]}) >= 3
    for n in (1, 4):
        _assert_identical(_generate(model, monkeypatch, "triton", graphs=True, n=n), eager)
    reference = _generate(model, monkeypatch, "torch", graphs=False)
    for a, b in zip(eager, reference, strict=True):
        assert a.output_token_ids == b.output_token_ids and a.exit_depths == b.exit_depths
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) <= 1e-5
    assert max_replay_error(model, eager, 1.0) <= 1e-5


def test_engine_bf16_triton_graphs_equal_eager_and_track_torch(monkeypatch):
    bf16 = torch.bfloat16
    eager = _generate(tiny_model(0), monkeypatch, "triton", graphs=False, dtype=bf16)
    _assert_identical(_generate(tiny_model(0), monkeypatch, "triton", graphs=True, dtype=bf16), eager)
    # a fixed depth: thresholded exits would flip on bf16 rounding and end the comparison early
    fixed = [SamplingParams(max_tokens=12, seed=s, logprobs=0, max_loops=3, ignore_eos=True) for s in range(5)]
    eager = _generate(tiny_model(0), monkeypatch, "triton", graphs=False, dtype=bf16, params=fixed)
    reference = _generate(tiny_model(0), monkeypatch, "torch", graphs=False, dtype=bf16, params=fixed)
    compared = 0
    for a, b in zip(eager, reference, strict=True):
        for ta, tb, da, db, la, lb in zip(
            a.output_token_ids, b.output_token_ids, a.exit_depths, b.exit_depths, a.log_probs, b.log_probs, strict=True
        ):
            if (ta, da) != (tb, db):
                break  # the paths' roundings differ; past a different token the contexts differ
            assert abs(la - lb) <= 5e-2
            compared += 1
    assert compared >= 20


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_engine_on_second_gpu_captures_its_graphs_there(monkeypatch):
    """An engine on cuda:1 in a process whose current device is cuda:0 (a PD decode
    worker's situation before it set its device): its CUDA graphs capture and replay on
    cuda:1 and give what the same engine gives on cuda:0."""
    torch.cuda.set_device(0)
    outs = {}
    for device in ("cuda:0", "cuda:1"):
        llm = LLM(
            tiny_model(0),
            device=device,
            max_num_seqs=4,
            kv_blocks=64,
            block_size=4,
            cuda_graphs=True,
            execution=ExecutionSettings(decode_attention="triton"),
        )
        try:
            outs[device] = llm.generate(prompts(5, seed=1), PARAMS)
            assert llm.runner.graphs, "no decode step was captured"
        finally:
            llm.close()
    assert torch.cuda.current_device() == 0
    _assert_identical(outs["cuda:1"], outs["cuda:0"])


@DTYPES
def test_overlapped_decode_equals_one_step_at_a_time(dtype):
    """Overlap (the CUDA default) under CUDA graphs: step n + 1 queued on the device's
    sampled tokens before step n is read, rows of ended sequences discarded; the outputs
    are bitwise those of stepping one at a time."""
    from tests.unit.engine.test_overlap import run

    options = dict(device="cuda", dtype=dtype, cuda_graphs=True)
    serial, _ = run(tiny_model(0), 8, overlap=False, **options)
    overlapped, c = run(tiny_model(0), 8, overlap=True, **options)
    _assert_identical(overlapped, serial)
    assert c["decode_steps_overlapped"] > 0 and c["decode_rows_discarded"] > 0 and c["decode_steps_eager"] == 0


def test_width_from_reach_keeps_the_bits_on_cuda():
    check_width_from_reach("cuda")


def test_a_rollout_captures_one_decode_graph_per_bucket():
    """Decode steps take their width from the rows' reach, so the growing context of a rollout
    needs no graph of its own at each power of two: one decode capture per batch bucket."""
    model = tiny_model(0).cuda()
    llm = LLM(model, max_num_seqs=4, kv_blocks=96, block_size=4, attn_chunk=8, cuda_graphs=True)
    try:
        params = [SamplingParams(max_tokens=40, seed=s, logprobs=0, max_loops=4, ignore_eos=True) for s in range(4)]
        llm.generate(prompts(4, seed=1), params)
        counters = llm.work_counters()
    finally:
        llm.close()
    # one prefill width (prompts of 3-12 tokens: 16) and one decode step (4 rows, bucket 8, all
    # running to the end); with widths that followed the context, 16, 32 and 64 were each captured
    assert counters["graph_captures"] == 2 and counters["prefill_steps_graphed"] == 4, counters
