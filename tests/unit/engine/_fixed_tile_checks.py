"""Checks of exact mode's fixed-tile linear kernel (ouro_cli/kernels/fixed_tile.py), shared by
the CPU tests (run here as a script under the Triton interpreter, in a process of its own)
and the GPU tests (imported, on CUDA, at the Ouro-1.4B shapes).

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/unit/engine/_fixed_tile_checks.py [reference_fp32 ...]
"""

from __future__ import annotations

import sys

import torch

from tests.unit.engine._gemv_kernel_checks import assert_close_to_reference, operands
from tests.unit.engine._interpreted import run_checks

# (N, K): N and K off the 64-wide tiles (40, 96, 130) and on them; one output column (the exit gate)
SHAPES = [(40, 96), (64, 128), (130, 64), (1, 64)]
ROWS = [1, 3, 64, 65, 130]
# batch sizes under the interpreter, whose tile is BASE's 64 rows: one tile, one past it, several
# with a partial last one (each row of the largest also runs alone: a launch per row)
CPU_BATCHES = (2, 8, 64, 65, 130)


def check_reference(device="cpu", dtype=torch.float32, shapes=SHAPES, rows=ROWS) -> None:
    """The kernel equals the fp64 product to fp32 precision (fp32) or to 1 ulp (16-bit)."""
    from ouro_cli.kernels.fixed_tile import fixed_tile_linear

    for case, (n, k) in enumerate(shapes):
        for m in rows:
            x, w = operands(m, n, k, dtype, device, seed=case)
            assert_close_to_reference(fixed_tile_linear(x, w), x, w, f"N={n} K={k} M={m}")


def check_batch_invariance(device="cpu", dtype=torch.float32, shapes=SHAPES[:3], rows=(2, 8, 64, 65, 130, 200)) -> None:
    """Row i's output is the same bits alone (M = 1), among the first rows of a batch of each
    size in `rows` (one tile, several, a partial last one) and with the rows reversed."""
    from ouro_cli.kernels.fixed_tile import fixed_tile_linear

    for case, (n, k) in enumerate(shapes):
        x, w = operands(max(rows), n, k, dtype, device, seed=10 + case)
        alone = torch.cat([fixed_tile_linear(x[i : i + 1], w) for i in range(max(rows))])
        for m in rows:
            together = fixed_tile_linear(x[:m], w)
            assert torch.equal(together, alone[:m]), f"N={n} K={k} M={m}: rows changed with M"
            assert torch.equal(fixed_tile_linear(x[:m].flip(0), w).flip(0), together), (
                f"N={n} K={k} M={m}: rows changed with order"
            )


def check_configs(device="cpu", dtype=torch.bfloat16, shapes=((130, 64), (40, 96)), rows=(1, 65, 600)) -> None:
    """Every tile config of CONFIGS computes every element once (the programs walk the tiles in
    groups of GROUP_M row blocks, the last group short), and its output is BASE's, bit for bit;
    `config_for` takes BASE for fp32 and off CUDA, and on CUDA each entry of CONFIGS for the rows
    and columns it holds and the entries before it do not."""
    from ouro_cli.kernels import fixed_tile

    configs = sorted({config for *_, config in fixed_tile.CONFIGS} - {fixed_tile.BASE})
    for case, (n, k) in enumerate(shapes):
        for m in rows:
            x, w = operands(m, n, k, dtype, device, seed=20 + case)
            base = fixed_tile.launch(x, w, fixed_tile.BASE)
            assert_close_to_reference(base, x, w, f"N={n} K={k} M={m}")
            for config in configs:
                if device == "cpu" and config[0] * config[1] * fixed_tile.block_k(dtype) > 2**20:
                    continue  # the interpreter's dot as a sum holds BLOCK_M x BLOCK_K x BLOCK_N: its limit
                assert torch.equal(fixed_tile.launch(x, w, config), base), f"{config} N={n} K={k} M={m}"
    assert fixed_tile.config_for(10**6, 10**6, torch.float32, "cuda") == fixed_tile.BASE
    assert fixed_tile.config_for(10**6, 10**6, torch.bfloat16, "cpu") == fixed_tile.BASE
    assert fixed_tile.CONFIGS[-1][:2] == (None, None)  # every call has a config
    for index, (rows_up_to, columns_up_to, config) in enumerate(fixed_tile.CONFIGS):
        before = [(r, c) for r, c, _ in fixed_tile.CONFIGS[:index]]
        m = rows_up_to or 10**6  # the largest call the entry holds
        n = columns_up_to or 10**6
        if any((r is None or m <= r) and (c is None or n <= c) for r, c in before):
            raise AssertionError(f"CONFIGS entry {index} is never reached at M={m}, N={n}")
        assert fixed_tile.config_for(m, n, torch.bfloat16, "cuda") == config, f"entry {index}"


def check_fused_columns(
    device="cpu", dtype=torch.bfloat16, parts=((40, 96), (24, 96), (64, 96)), rows=(1, 65, 300)
) -> None:
    """A weight stacked from parts ([q;k;v], [gate;up]: model/fusion.py, the engine's) gives each
    part's columns the bits that part alone gives: an output column is a function of its own
    weight row and the input row, whatever the matrix's width (the tile shape comes from the
    row count only)."""
    from ouro_cli.kernels.fixed_tile import fixed_tile_linear

    k = parts[0][1]
    for m in rows:
        x, _ = operands(m, 1, k, dtype, device, seed=30 + m)
        ws = [operands(1, n, k, dtype, device, seed=40 + i)[1] for i, (n, _) in enumerate(parts)]
        fused = fixed_tile_linear(x, torch.cat(ws))
        assert torch.equal(fused, torch.cat([fixed_tile_linear(x, w) for w in ws], dim=1)), f"M={m}"


def check_bad_input(device="cpu") -> None:
    """Shapes and dtypes it does not take raise ValueError before any launch."""
    from ouro_cli.kernels.fixed_tile import fixed_tile_linear

    x, w = operands(4, 32, 64, torch.float32, device)
    for what, (xb, wb) in {
        "K mismatch": (x[:, :48], w),
        "dtype mismatch": (x.bfloat16(), w),
        "fp64": (x.double(), w.double()),
        "1-D x": (x[0], w),
    }.items():
        try:
            fixed_tile_linear(xb, wb)
        except ValueError:
            continue
        raise AssertionError(f"{what}: no ValueError")


def check_exact_engine(device="cpu", dtype=torch.float32, kv_cache_dtype="auto", requests=3) -> None:
    """Exact mode's Triton path end to end (what it runs on CUDA: the fixed-tile projections,
    the decode kernel for the decode step, the prefill and the replay): the tiny model's
    engine, with threshold exits, reports the logprobs of its replay to the bit, whether the
    replay runs each loop on every position or gathers the positions that run it
    (model/ouro.py `gathering_allowed`). The engine multiplies by fused [q;k;v] and [gate;up]
    weights (as on CUDA, model/fusion.py), the replay by the separate ones (as the trainer).
    With `kv_cache_dtype="fp8"` the decode kernel reads the packed fp8 cache and the replay's
    kernel the K/V its layers rounded the same way: still the same bits."""
    import copy

    from ouro_cli.engine import LLM, SamplingParams
    from ouro_cli.model import fuse_projections, ouro, pointwise
    from ouro_cli.settings import ExecutionSettings, executing
    from tests.unit.engine.conftest import prompts, tiny_model

    exact = ExecutionSettings(exact=True, kv_cache_dtype=kv_cache_dtype)
    assert exact.effective(device)["replay_attention"] == "paged"  # the kernels, not model/exact.py's torch
    model = tiny_model(0).to(device, dtype)
    model.execution = exact  # the replay's settings, as the trainer's model gets them
    engine_model = copy.deepcopy(model)
    fuse_projections(engine_model)
    assert engine_model.model.layers[0].self_attn.qkv_weight is not None
    assert model.model.layers[0].self_attn.qkv_weight is None
    params = [
        SamplingParams(max_tokens=4, seed=s, logprobs=0, exit_threshold=0.5, ignore_eos=True) for s in range(requests)
    ]
    llm = LLM(engine_model, max_num_seqs=3, kv_blocks=16, block_size=4, cuda_graphs=False, execution=exact)
    try:
        outs = llm.generate(prompts(3, seed=1, hi=6)[:requests], params)
    finally:
        llm.close()
    assert llm.runner.attention == "triton" and llm.runner.kv.fp8 == (kv_cache_dtype == "fp8")
    for out in outs:
        m, r = len(out.prompt_token_ids), out.output_token_ids
        ids = torch.tensor([out.prompt_token_ids + r], device=device)
        depths = torch.tensor([[4] * m + out.exit_depths[1:] + [4]], device=device)
        for share in (0.0, 1.0):  # every loop on every position; every loop that not all run gathered
            before, ouro.GATHER_BELOW = ouro.GATHER_BELOW, share
            try:
                with torch.no_grad(), executing(exact):
                    ran = ouro.positions_per_loop(depths)
                    logp = pointwise.log_softmax(model(ids, depths=depths)[0].float())
            finally:
                ouro.GATHER_BELOW = before
            assert share == 0.0 or min(ran) < depths.numel() or min(out.exit_depths[1:], default=4) == 4, ran
            ref = logp[m - 1 : m - 1 + len(r)].gather(1, torch.tensor(r, device=device)[:, None]).squeeze(1)
            assert torch.equal(torch.tensor(out.log_probs, dtype=torch.float64), ref.double().cpu()), (
                share,
                out.exit_depths,
            )


def check_exact_engine_grouped(device="cpu", dtype=torch.bfloat16) -> None:
    """`check_exact_engine` with fresh prompts prefilled both ways CUDA prefills them: the short
    ones at their bucket width, in a group of rows filled up with a row of padding
    (runner.prefill_many; groups of 3 rows here, where the interpreter would take minutes over
    CUDA's 32, at buckets from 8 where CUDA's start at 16: still wider than the prompts), and the
    one past PREFILL_GRAPH_MAX (4 here) alone at its own width."""
    from ouro_cli.engine import runner
    from tests.unit.engine.conftest import prompts

    lengths = sorted(len(p) for p in prompts(3, seed=1, hi=6))  # check_exact_engine's prompts
    assert lengths[1] <= 4 < lengths[2], lengths  # two share a group, one runs alone
    before = runner.BUCKETED_PREFILL, runner.MAX_PREFILL_GROUP, runner.PREFILL_GRAPH_MAX, runner.prefill_bucket
    runner.BUCKETED_PREFILL, runner.MAX_PREFILL_GROUP, runner.PREFILL_GRAPH_MAX = (device, "cuda"), 3, 4
    runner.prefill_bucket = lambda n: max(8, 1 << (n - 1).bit_length())  # a power of two, as on CUDA
    try:
        check_exact_engine(device, dtype)
    finally:
        runner.BUCKETED_PREFILL, runner.MAX_PREFILL_GROUP, runner.PREFILL_GRAPH_MAX, runner.prefill_bucket = before


CHECKS = {
    "reference_fp32": check_reference,
    "reference_bf16": lambda: check_reference(dtype=torch.bfloat16),
    "batch_invariance_fp32": lambda: check_batch_invariance(rows=CPU_BATCHES),
    "batch_invariance_bf16": lambda: check_batch_invariance(dtype=torch.bfloat16, rows=CPU_BATCHES),
    "bad_input": check_bad_input,
    "configs": check_configs,
    "fused_columns": check_fused_columns,
    "exact_engine_fp32": check_exact_engine,
    "exact_engine_grouped_bf16": check_exact_engine_grouped,
    "exact_engine_fp8_bf16": lambda: check_exact_engine(dtype=torch.bfloat16, kv_cache_dtype="fp8", requests=2),
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
