"""`ouro compare`'s training-update check (ouro_cli.checks.compare): ‖w_B − w_A‖ / ‖w_A − w_0‖
from squared norms, including runs whose weights never moved (no 0/0)."""

from __future__ import annotations

from ouro_cli.checks.compare import relative_update_diff


def test_the_ratio_of_the_norms():
    assert relative_update_diff(1.0, 4.0) == {"rel_diff": 0.5}
    assert relative_update_diff(0.0, 4.0) == {"rel_diff": 0.0}


def test_runs_that_never_moved_agree_when_equal_and_cannot_be_judged_otherwise():
    same = relative_update_diff(0.0, 0.0)
    assert same["rel_diff"] == 0.0 and "neither run moved" in same["note"]
    apart = relative_update_diff(1e-6, 0.0)
    assert apart["rel_diff"] is None and "run A's weights never moved" in apart["note"]
