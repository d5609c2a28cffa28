"""The data cursor: seeded per-epoch orders, batches across epoch boundaries, exact resume.

The reference order is computed here with plain Python integers (64-bit masks, `sorted`),
independently of the numpy code under test, and a few values are pinned so that a
change of the order -- which would silently change every resumed run -- fails a test.
"""

from __future__ import annotations

import json

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl.cursor import DataCursor, epoch_order

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference_order(seed: int, epoch: int, size: int) -> list[int]:
    key = mix((mix(seed) + epoch * GOLDEN) & M64)
    keys = [mix((key + (i + 1) * GOLDEN) & M64) for i in range(size)]
    return sorted(range(size), key=lambda i: (keys[i], i))


@pytest.mark.parametrize(
    "seed,epoch,size", [(0, 0, 1), (0, 0, 10), (1, 0, 10), (1, 1, 10), (2**64 - 1, 7, 33), (1234, 3, 1000)]
)
def test_order_matches_reference(seed, epoch, size):
    order = epoch_order(seed, epoch, size).tolist()
    assert order == reference_order(seed, epoch, size)
    assert sorted(order) == list(range(size))


def test_pinned_values():
    # If these change, saved cursors no longer resume to the same rows: do not "fix" casually.
    assert epoch_order(0, 0, 8).tolist() == [2, 4, 6, 5, 1, 7, 0, 3]
    assert epoch_order(42, 0, 10).tolist() == [2, 6, 3, 1, 5, 0, 4, 7, 9, 8]
    assert epoch_order(42, 1, 10).tolist() == [5, 0, 7, 3, 8, 9, 4, 1, 2, 6]


def test_epochs_differ_and_seeds_differ():
    assert epoch_order(5, 0, 50).tolist() != epoch_order(5, 1, 50).tolist()
    assert epoch_order(5, 0, 50).tolist() != epoch_order(6, 0, 50).tolist()


def test_batches_walk_epochs_in_order():
    size, seed = 7, 3
    cursor = DataCursor(size, seed)
    drawn = [cursor.next_batch(3) for _ in range(5)]  # 15 rows: two full epochs and one row
    flat = [i for b in drawn for i in b]
    expected = reference_order(seed, 0, size) + reference_order(seed, 1, size) + reference_order(seed, 2, size)[:1]
    assert flat == expected
    assert cursor.state_dict() == {"seed": 3, "size": 7, "epoch": 2, "offset": 1}


def test_batch_larger_than_the_data():
    cursor = DataCursor(3, 0)
    batch = cursor.next_batch(7)
    assert batch == reference_order(0, 0, 3) + reference_order(0, 1, 3) + reference_order(0, 2, 3)[:1]
    assert (cursor.epoch, cursor.offset) == (2, 1)


def test_same_seed_same_sequence():
    a, b = DataCursor(11, 9), DataCursor(11, 9)
    assert [a.next_batch(4) for _ in range(6)] == [b.next_batch(4) for _ in range(6)]


@pytest.mark.parametrize("stop_after", [0, 1, 2, 5, 9])
def test_resume_reproduces_the_continuous_sequence(stop_after):
    continuous = DataCursor(10, 77)
    expected = [continuous.next_batch(4) for _ in range(10)]

    first = DataCursor(10, 77)
    got = [first.next_batch(4) for _ in range(stop_after)]
    saved = json.loads(json.dumps(first.state_dict()))  # as written into a checkpoint
    resumed = DataCursor(10, 77)
    resumed.load_state_dict(saved)
    got += [resumed.next_batch(4) for _ in range(10 - stop_after)]
    assert got == expected
    assert DataCursor.from_state(saved).state_dict() == saved


def test_load_rejects_other_seed_or_size():
    state = DataCursor(10, 1).state_dict()
    with pytest.raises(UserError, match="seeded with 1, this run with 2.*--seed"):
        DataCursor(10, 2).load_state_dict(state)
    with pytest.raises(UserError, match="walks 10 rows, the data now has 11.*--data"):
        DataCursor(11, 1).load_state_dict(state)
    with pytest.raises(UserError, match="lacks offset"):
        DataCursor(10, 1).load_state_dict({"seed": 1, "size": 10, "epoch": 0})
    with pytest.raises(UserError, match="invalid"):
        DataCursor(10, 1).load_state_dict({"seed": 1, "size": 10, "epoch": 0, "offset": 10})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(size=0, seed=0),
        dict(size=3, seed=-1),
        dict(size=3, seed=2**64),
        dict(size=3, seed=0, offset=3),
        dict(size=3, seed=0, epoch=-1),
        dict(size=3, seed=1.0),
    ],
)
def test_bad_construction(kwargs):
    with pytest.raises(ValueError):
        DataCursor(**kwargs)


def test_bad_batch_size():
    with pytest.raises(ValueError):
        DataCursor(3, 0).next_batch(0)
