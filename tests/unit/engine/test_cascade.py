"""The cascade (shared-prefix) decode attention.

The plan (engine/cascade.py), property-tested against a plain per-pair reference: which rows
get how many prefix tiles, and how the prefix programs hold them. The bounds check of its
tables (kernels/bounds.py) refuses a program whose rows do not share their slots.

Under the Triton interpreter (_cascade_checks.py, in one subprocess): the kernel with the
cascade gives the bits it gives without (G = 1 and 2; fp32, bf16 and packed fp8; prompts
below, at and past tile boundaries; groups of 1 to 17 beside lone rows), the fused KV write
too with exited rows (packed fp8 rows as well), and an engine decoding GRPO groups gives the
same tokens, depths and logprobs with the cascade on and off.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ouro_cli.engine.cascade import COUNT, FIRST, MEMBERS, TILES, cascade_plan
from ouro_cli.kernels import bounds

from ._interpreted import interpreted_tests

pytest.importorskip("triton")

report, test_cascade_under_the_interpreter = interpreted_tests("_cascade_checks.py", ["bits", "write", "engine"])

SCRATCH = 10_000  # the padding block id


@st.composite
def batches(draw):
    """Block tables and positions of a decode batch: groups sharing their first blocks (none:
    every row its own), duplicated rows (a sequence's speculative rows), padding rows."""
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    ids = iter(range(SCRATCH))
    tables, positions = [], []
    for _ in range(draw(st.integers(0, 5))):
        shared = [next(ids) for _ in range(draw(st.integers(0, 8)))]
        for _ in range(draw(st.integers(1, 6))):
            table = shared + [next(ids) for _ in range(draw(st.integers(1 if not shared else 0, 4)))]
            pos = draw(st.integers(0, len(table) * bs - 1))
            for extra in range(draw(st.integers(1, 2))):
                tables.append(table)
                positions.append(min(pos + extra, len(table) * bs - 1))
    tables += [[]] * draw(st.integers(0 if tables else 1, 3))
    positions += [0] * (len(tables) - len(positions))
    order = draw(st.permutations(range(len(tables))))
    width = max(1, max(len(t) for t in tables))
    table = np.full((len(tables), width), SCRATCH, dtype=np.int64)
    for row, i in enumerate(order):
        table[row, : len(tables[i])] = tables[i]
    return table, np.array([positions[i] for i in order], dtype=np.int64), bs


def reference_tiles(table, positions, bs, tile, min_tiles=1) -> list[int]:
    """Per row: its bucket's (rows with its first block) shortest common prefix over every pair,
    in positions, cut to below every member's position, in whole tiles; 0 alone or below
    `min_tiles`."""
    b = len(positions)
    out = []
    for i in range(b):
        bucket = [j for j in range(b) if table[j][0] == table[i][0]]
        if len(bucket) < 2:
            out.append(0)
            continue
        shared = min(int(positions[j]) for j in bucket)
        for j in bucket:
            for k in bucket:
                same = 0
                while same < table.shape[1] and table[j][same] == table[k][same]:
                    same += 1
                shared = min(shared, same * bs)
        out.append(shared // tile if shared // tile >= min_tiles else 0)
    return out


@settings(max_examples=300, deadline=None)
@given(batches(), st.sampled_from([1, 4, 16, 64]), st.sampled_from([1, 2, 3, 8, 16]), st.sampled_from([1, 2, 3]))
def test_plan_gives_each_bucket_its_shared_tiles_in_programs_of_at_most_per(batch, tile, per, min_tiles):
    table, positions, bs = batch
    plan = cascade_plan(table, positions, bs, tile, per, min_tiles)
    b = len(positions)
    assert plan.shape == (4, b) and plan.dtype == np.int64
    if per < 2 or b < 2:
        assert not plan.any()
        return
    assert plan[TILES].tolist() == reference_tiles(table, positions, bs, tile, min_tiles)
    rows = np.flatnonzero(plan[TILES])
    programs = int((plan[COUNT] > 0).sum())
    assert (plan[COUNT, programs:] == 0).all() and (plan[FIRST, programs:] == 0).all()
    assert (plan[COUNT, :programs] <= per).all()
    assert (plan[FIRST, :programs] == np.cumsum(np.r_[0, plan[COUNT, :programs]])[:programs]).all()
    held = plan[MEMBERS, : rows.shape[0]]
    assert sorted(held.tolist()) == rows.tolist() and (plan[MEMBERS, rows.shape[0] :] == 0).all()
    per_bucket: dict[int, list[int]] = {}
    for p in range(programs):
        members = held[plan[FIRST, p] : plan[FIRST, p] + plan[COUNT, p]]
        lead = members[0]
        n = int(plan[TILES, lead]) * tile
        assert (plan[TILES, members] == plan[TILES, lead]).all()
        assert (positions[members] >= n).all()  # the current position is never in the prefix
        slots = np.arange(n)
        assert (table[members][:, slots // bs] == table[lead, slots // bs]).all()
        assert (table[members, 0] == table[lead, 0]).all()
        per_bucket.setdefault(int(table[lead, 0]), []).append(len(members))
    for first_block, sizes in per_bucket.items():  # consecutive programs, full but the last
        assert sizes[:-1] == [per] * (len(sizes) - 1), (first_block, sizes)
        assert sum(sizes) == int((plan[TILES] > 0)[table[:, 0] == first_block].sum())


def test_bounds_check_refuses_programs_that_do_not_share_their_slots():
    ctx = torch.tensor([[5, 6, 7, 1], [5, 6, 8, 2], [5, 9, 8, 3]])
    lengths = torch.tensor([4, 4, 4])

    def cascade(tiles, members, first, count):
        return SimpleNamespace(
            tiles=torch.tensor(tiles),
            members=torch.tensor(members),
            first=torch.tensor(first),
            count=torch.tensor(count),
            tile=1,
        )

    bounds.check_cascade("k", ctx, lengths, cascade([2, 2, 0], [0, 1, 0], [0, 0, 0], [2, 0, 0]), 16)
    bad = {
        "unshared slots": cascade([2, 0, 2], [0, 2, 0], [0, 0, 0], [2, 0, 0]),
        "prefix reaching the length": cascade([4, 4, 0], [0, 1, 0], [0, 0, 0], [2, 0, 0]),
        "row held twice": cascade([2, 2, 0], [0, 1, 0], [0, 0, 0], [2, 2, 0]),
        "row with tiles not held": cascade([2, 2, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0]),
        "too many rows": cascade([2, 2, 0], [0, 1, 0], [0, 0, 0], [2, 0, 0]),
    }
    for name, c in bad.items():
        with pytest.raises(bounds.KernelIndexError):
            bounds.check_cascade("k", ctx, lengths, c, 1 if name == "too many rows" else 16)
