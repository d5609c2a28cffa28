"""Which rows of a decode step share a prefix of their context: the tables of the cascade pass.

The samples of a GRPO group reference the same full prompt blocks (scheduler.py), so their
block tables start alike. The Triton decode attention then reads such a shared prefix once
per group and loop (kernels/decode_attention.py `Cascade`): a prefix pass folds the shared
tiles for all members at once and stores each row's online-softmax state, and the decode
kernel resumes each row from it. The tiles are folded by the same instructions in the same
order either way, so every row's output keeps its bits: what rows are grouped here is a
question of speed, never of numerics.

A *bucket* is the rows whose tables start with the same block: they share the longest common
prefix of their tables (the same blocks, so the same slots and K/V). Its prefix is that
common prefix cut to a whole number of tiles and to below every member's position (the
current position, written by this step, is never in it). A bucket of two or more rows with
at least `min_tiles` such tiles goes to prefix programs of at most `per_program` rows each.

The engine asks for MIN_TILES: a prefix pass has a fixed cost (one more kernel, each row's
state stored and loaded), which a prefix of one or two tiles does not repay
(bench/cascade.py sweeps prompt lengths; docs/performance.md has the figures).
"""

from __future__ import annotations

import numpy as np

TILES, MEMBERS, FIRST, COUNT = range(4)  # the rows of `cascade_plan`'s table
MIN_TILES = 3  # the shortest shared prefix, in tiles, that the engine reads once per group


def cascade_plan(
    table: np.ndarray, positions: np.ndarray, block_size: int, tile: int, per_program: int, min_tiles: int = 1
) -> np.ndarray:
    """Block tables [B, blocks] (padded with any id past the real ones) and positions [B] (each
    row's cached length, its prefix's bound) -> int64 [4, B]:

    - TILES: row b's prefix tiles (0: none, or fewer than `min_tiles`);
    - MEMBERS: the rows with prefix tiles, bucket by bucket in row order;
    - FIRST, COUNT: prefix program p holds MEMBERS[FIRST[p] : FIRST[p] + COUNT[p]], consecutive
      members of one bucket, at most `per_program` of them; unused programs count 0.

    A plan of zeros when programs hold fewer than two rows (nothing would be read once)."""
    b = positions.shape[0]
    plan = np.zeros((4, b), dtype=np.int64)
    if per_program < 2 or b < 2:
        return plan
    _, leader, bucket = np.unique(table[:, 0], return_index=True, return_inverse=True)
    bucket = bucket.reshape(-1)
    same = table == table[leader[bucket]]
    common = np.where(same.all(axis=1), table.shape[1], same.argmin(axis=1))  # blocks shared with the leader
    reach = np.full(leader.shape[0], np.iinfo(np.int64).max)
    np.minimum.at(reach, bucket, np.minimum(common * block_size, positions))
    tiles = reach // tile
    tiles[(np.bincount(bucket) < 2) | (tiles < min_tiles)] = 0
    plan[TILES] = tiles[bucket]
    rows = np.flatnonzero(plan[TILES])
    rows = rows[np.argsort(bucket[rows], kind="stable")]
    at = np.arange(rows.shape[0])
    starts = np.r_[True, bucket[rows][1:] != bucket[rows][:-1]]
    bucket_start = np.maximum.accumulate(np.where(starts, at, 0))
    heads = np.flatnonzero((at - bucket_start) % per_program == 0)
    plan[MEMBERS, : rows.shape[0]] = rows
    plan[FIRST, : heads.shape[0]] = heads
    plan[COUNT, : heads.shape[0]] = np.diff(np.r_[heads, rows.shape[0]])
    return plan
