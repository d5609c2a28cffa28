"""Checks of the cascade (shared-prefix) decode attention, shared by the CPU tests (run here as
a script under the Triton interpreter, in a process of its own: _interpreted.py says why) and
the GPU tests (imported, on CUDA).

The cascade must not change a bit: every check compares the kernel with and without it with
`torch.equal`, on batches whose rows share prompt blocks as a GRPO group's samples do, and
checks that the prefix pass did run (the plan gave some row prefix tiles).

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/unit/engine/_cascade_checks.py [bits ...]
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from ouro_cli.engine.cascade import TILES, cascade_plan
from tests.unit.engine._interpreted import run_checks


def shared_prefix_batch(groups, block_size: int, hkv: int, d: int, dtype, device, seed: int = 0):
    """Rows of `groups` [(prompt length, [response lengths])], each group's full prompt blocks
    shared by its members, every other block a row's own, block ids shuffled; rows of the
    groups interleaved. -> (k_plane, v_plane [Hkv, slots + 1, D] with the scratch slot last,
    block tables [B, blocks] padded with the scratch block, slot table [B, width], lengths [B])."""
    g = torch.Generator().manual_seed(seed)
    rows = []  # (group, prompt length, length)
    for i, (prompt, responses) in enumerate(groups):
        rows += [(i, prompt, prompt + r) for r in responses]
    rows = [rows[j] for j in torch.randperm(len(rows), generator=g).tolist()]
    longest = max(n for _, _, n in rows)
    nb = -(-longest // block_size)
    total = sum(p // block_size for p, _ in groups) + sum(-(-n // block_size) for _, _, n in rows)
    ids = iter(torch.randperm(total, generator=g).tolist())
    shared = {i: [next(ids) for _ in range(p // block_size)] for i, (p, _) in enumerate(groups)}
    table = np.full((len(rows), nb), total, dtype=np.int64)  # `total`: the scratch block
    for row, (i, _, n) in enumerate(rows):
        own = shared[i] + [next(ids) for _ in range(-(-n // block_size) - len(shared[i]))]
        table[row, : len(own)] = own
    scratch = total * block_size
    width = nb * block_size
    pos = torch.arange(width)
    slots = torch.from_numpy(table)[:, pos // block_size] * block_size + pos % block_size
    lengths = torch.tensor([n for _, _, n in rows])
    slots = torch.where(pos[None, :] < lengths[:, None], slots, scratch)
    planes = [torch.randn(hkv, scratch + 1, d, generator=g).to(device, dtype) for _ in range(2)]
    return planes[0], planes[1], table, slots.to(device), lengths.to(device)


def plan_for(table, lengths, block_size: int, g: int, hq: int, d: int, tile: int):
    """The engine's plan for these rows as the kernel's `Cascade` (positions = lengths - 1)."""
    from ouro_cli.kernels.decode_attention import Cascade, queries_per_program

    positions = lengths.cpu().numpy() - 1
    plan = cascade_plan(table, positions, block_size, tile, queries_per_program(g))
    assert plan[TILES].any(), "no row got prefix tiles: the check would not run the prefix pass"
    return Cascade.from_plan(torch.from_numpy(plan).to(lengths.device), hq, d, tile)


# (G, block size, tile, groups): prompts below, at and past tile boundaries; groups of 1..17
# (17 > 16 rows: two prefix programs at G = 1, three at G = 2) beside lone rows
BIT_CASES = [
    (1, 16, 64, [(5, [1, 3]), (64, [1, 2, 5]), (100, [1] * 16), (130, [4, 9]), (70, [2])]),
    (2, 16, 64, [(100, [3] * 9), (64, [1, 1]), (130, [2, 6, 1]), (5, [1]), (66, [60, 1])]),
    (1, 4, 16, [(33, list(range(1, 18))), (16, [1, 1]), (47, [3]), (20, [1, 17])]),
    (2, 16, 64, [(1024, [1, 5, 70]), (80, [1])]),
]


def check_bits(device="cpu", hkv=2, d=16, cases=BIT_CASES) -> None:
    """paged_decode_attention with the cascade gives the bits it gives without, in fp32, bf16
    and over packed fp8 rows (bf16 queries), for G = 1 and 2."""
    from ouro_cli.kernels.decode_attention import paged_decode_attention
    from ouro_cli.model import kv_quant

    for case, (g, bs, tile, groups) in enumerate(cases):
        for dtype, fp8 in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
            k, v, table, ctx, lens = shared_prefix_batch(groups, bs, hkv, d, dtype, device, seed=case)
            if fp8:
                k, v = kv_quant.pack(k.float()), kv_quant.pack(v.float())
            q = torch.randn(ctx.shape[0], hkv * g, d, generator=torch.Generator().manual_seed(case)).to(device, dtype)
            cascade = plan_for(table, lens, bs, g, hkv * g, d, tile)
            plain = paged_decode_attention(q, k, v, ctx, lens, block=tile)
            got = paged_decode_attention(q, k, v, ctx, lens, block=tile, cascade=cascade)
            assert torch.equal(got, plain), (case, dtype, fp8, (got.float() - plain.float()).abs().max().item())


def check_write(device="cpu", hkv=2, d=16) -> None:
    """write_kv_and_attend with the cascade, plane t > 0 with exited rows carrying plane t-1:
    the planes and the output have the bits of the kernel without it (fp32, bf16, and packed
    fp8 rows with bf16 queries)."""
    from ouro_cli.kernels.decode_attention import write_kv_and_attend
    from ouro_cli.model import kv_quant

    gen = torch.Generator().manual_seed(7)
    for dtype, fp8 in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        groups = [(70, [1, 4, 2, 9]), (16, [3]), (130, [1, 1, 2])]
        k0, v0, table, ctx, lens = shared_prefix_batch(groups, 16, hkv, d, dtype, device, seed=3)
        k1, v1 = torch.randn(k0.shape, generator=gen).to(device, dtype), torch.randn(k0.shape, generator=gen)
        v1 = v1.to(device, dtype)
        if fp8:
            k0, v0, k1, v1 = (kv_quant.pack(x) for x in (k0, v0, k1, v1))
        b, g = ctx.shape[0], 2
        new_slots = ctx.gather(1, (lens - 1)[:, None])[:, 0]
        q = torch.randn(b, hkv * g, d, generator=gen).to(device, dtype)
        k_new, v_new = (torch.randn(b, hkv, d, generator=gen).to(device, dtype) for _ in range(2))
        active = torch.arange(b, device=device) % 3 != 1
        cascade = plan_for(table, lens, 16, g, hkv * g, d, 64)
        runs = []
        for with_cascade in (None, cascade):
            planes = [x.clone() for x in (k1, v1)]
            out = write_kv_and_attend(
                q, *planes, k0, v0, new_slots, k_new, v_new, active, ctx, lens, cascade=with_cascade
            )
            runs.append((out, *planes))
        assert all(torch.equal(x, y) for x, y in zip(*runs, strict=True)), (dtype, fp8)


def check_graph_capture(device="cuda", hkv=16, d=128, dtype=torch.bfloat16) -> None:
    """write_kv_and_attend with the cascade captured in a CUDA graph while the plan's tables hold
    zeros (no prefix: a capture's warm-up inputs), replayed after the step's plan is copied into
    them: the planes and the output have the eager kernel's bits without the cascade."""
    from ouro_cli.kernels.decode_attention import Cascade, queries_per_program, write_kv_and_attend

    gen = torch.Generator().manual_seed(11)
    groups = [(1000, [1, 40, 200, 3, 90, 256, 7, 128]), (100, [256] * 8), (300, [5])]
    k0, v0, table, ctx, lens = shared_prefix_batch(groups, 16, hkv, d, dtype, device, seed=11)
    k1, v1 = (torch.randn(k0.shape, generator=gen).to(device, dtype) for _ in range(2))
    b = ctx.shape[0]
    new_slots = ctx.gather(1, (lens - 1)[:, None])[:, 0]
    q = torch.randn(b, hkv, d, generator=gen).to(device, dtype)
    k_new, v_new = (torch.randn(b, hkv, d, generator=gen).to(device, dtype) for _ in range(2))
    active = torch.arange(b, device=device) % 4 != 1
    plan = cascade_plan(table, lens.cpu().numpy() - 1, 16, 64, queries_per_program(1))
    tables = torch.zeros(4, b, dtype=torch.long, device=device)
    cascade = Cascade.from_plan(tables, hkv, d)
    planes = [x.clone() for x in (k1, v1)]

    def step():
        return write_kv_and_attend(q, *planes, k0, v0, new_slots, k_new, v_new, active, ctx, lens, cascade=cascade)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles both kernels
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = step()
    assert plan[TILES].any()
    tables.copy_(torch.from_numpy(plan))
    for x, y in zip(planes, (k1, v1), strict=True):
        x.copy_(y)
    graph.replay()
    want_planes = [x.clone() for x in (k1, v1)]
    want = write_kv_and_attend(q, *want_planes, k0, v0, new_slots, k_new, v_new, active, ctx, lens)
    torch.cuda.synchronize(device)
    assert torch.equal(out, want) and all(torch.equal(x, y) for x, y in zip(planes, want_planes, strict=True))


def _group_requests():
    """Two GRPO groups of 3 on prompts of 72-80 tokens (a 64-position tile shared at 8-token
    blocks) and a lone request, with threshold exits."""
    from ouro_cli.engine import SamplingParams
    from tests.unit.engine.conftest import prompts

    group_prompts = [p * 2 for p in prompts(2, seed=4, lo=36, hi=40)]
    requests = [p for p in group_prompts for _ in range(3)] + prompts(1, seed=5, lo=70, hi=70)
    params = [
        SamplingParams(max_tokens=3, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True)
        for s in range(len(requests))
    ]
    return requests, params


def _generate(model, device, cascade: bool, execution):
    """`_group_requests` on an engine (CUDA graphs on CUDA) -> (outputs, whether a step gave rows
    prefix tiles)."""
    from ouro_cli.engine import LLM
    from ouro_cli.engine.runner import DecodeInputs

    llm = LLM(
        model,
        max_num_seqs=8,
        kv_blocks=96,
        block_size=8,
        device=device,
        cuda_graphs=device == "cuda",
        cascade=cascade,
        execution=execution,
    )
    assert llm.runner.attention == "triton"
    tiles, plain = [], llm.runner._inputs

    def spy(*args):
        inputs = plain(*args)
        tiles.append(int(inputs.ints[:, DecodeInputs.CASCADE].max()))
        return inputs

    llm.runner._inputs = spy
    llm.runner.cascade_min_tiles = 1  # the prompts share one tile; the engine's own floor is higher
    try:
        return llm.generate(*_group_requests()), max(tiles) > 0
    finally:
        llm.close()


def check_engine(device="cpu") -> None:
    """An engine (Triton attention; CUDA graphs on CUDA) decoding GRPO groups whose prompts span
    a tile gives the same tokens, depths and logprobs, bit for bit, with the cascade on and off;
    on, its steps did give rows prefix tiles."""
    from ouro_cli.settings import ExecutionSettings
    from tests.unit.engine.conftest import tiny_model

    model = tiny_model(0).to(device)
    outs = {}
    for cascade in (False, True):
        outs[cascade], used = _generate(model, device, cascade, ExecutionSettings(decode_attention="triton"))
        assert used == cascade
    for a, b in zip(outs[False], outs[True], strict=True):
        assert (a.output_token_ids, a.exit_depths, a.log_probs) == (b.output_token_ids, b.exit_depths, b.log_probs)


def check_exact_engine(device="cuda", dtype=torch.bfloat16) -> None:
    """Exact mode, which runs this kernel on CUDA, with the cascade on: an engine decoding GRPO
    groups reports the logprobs of the trainer's replay to the bit."""
    import copy

    from ouro_cli.model import fuse_projections, pointwise
    from ouro_cli.settings import ExecutionSettings, executing
    from tests.unit.engine.conftest import tiny_model

    exact = ExecutionSettings(exact=True)
    model = tiny_model(0).to(device, dtype)
    model.execution = exact
    engine_model = copy.deepcopy(model)
    fuse_projections(engine_model)
    outs, used = _generate(engine_model, device, True, exact)
    assert used
    for out in outs:
        m, r = len(out.prompt_token_ids), out.output_token_ids
        ids = torch.tensor([out.prompt_token_ids + r], device=device)
        depths = torch.tensor([[4] * m + out.exit_depths[1:] + [4]], device=device)
        with torch.no_grad(), executing(exact):
            logp = pointwise.log_softmax(model(ids, depths=depths)[0].float())
        ref = logp[m - 1 : m - 1 + len(r)].gather(1, torch.tensor(r, device=device)[:, None]).squeeze(1)
        assert torch.equal(torch.tensor(out.log_probs, dtype=torch.float64), ref.double().cpu()), out.exit_depths


CHECKS = {"bits": check_bits, "write": check_write, "engine": check_engine}

if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
