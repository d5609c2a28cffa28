"""The decode batch over time in an update's line (`metrics.tenths`): the mean rows of each tenth
of the decode steps, every step in exactly one tenth, in order."""

from __future__ import annotations

import pytest

from ouro_cli.rl.metrics import tenths

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(1, 512), max_size=300))
def test_tenths_cover_every_step_in_order(batches):
    parts = tenths(batches)
    assert len(parts) == min(10, len(batches))
    n, k = len(batches), len(parts)
    for i, mean in enumerate(parts):  # part i is the mean of its own slice of the steps
        chunk = batches[round(i * n / k) : round((i + 1) * n / k)]
        assert chunk and mean == round(sum(chunk) / len(chunk), 1)
