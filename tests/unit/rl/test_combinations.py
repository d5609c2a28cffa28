"""The option matrix (ouro_cli/rl/combinations.py): every pair of the options that change what a
run trains or samples is either run by a named test or refused up front, never neither; the
tests it names exist and spell both options of every pair they are named for; a refused pair is
refused by option validation with its one-line reason, every other pair passes it; and
docs/grpo.md §7 is the table as the code generates it."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl import combinations as table
from ouro_cli.rl.options import TrainOptions

REPO = Path(__file__).resolve().parents[3]

# How a test turns each option on: its flag, or the keyword a unit test passes the trainer.
SPELLINGS = {
    "advantage": ('"--advantage"',),
    "steps": ('"--mini-batches"', '"--epochs"', "epochs="),
    "is": ('"--is-correction"', "is_correction="),
    "clip-c": ('"--clip-ratio-c"', "clip_ratio_c="),
    "exact": ('"--exact"',),
    "fp8": ('"--kv-cache-dtype"', "kv_cache_dtype="),
    "loops": ('"--loop-weighting"', "loop_weighting="),
    "filter": ('"--filter-groups"',),
    "overlong": ('"--overlong"',),
    "threshold": ('"--exit-threshold"',),
    "async": ('"--async-scheduling"',),
    "spec": ('"--speculative-tokens"', "speculative_tokens="),
    "pd": ('"--prefill-devices"',),
    "ranks": ('"--nproc-per-node"',),
    "offload": ('"--offload-optimizer"',),
}


def test_every_pair_is_tested_or_refused(capsys):
    counts = table.counts()
    with capsys.disabled():
        print(
            f"\noption pairs: {counts['tested']} tested, {counts['refused']} refused, "
            f"{counts['untested']} untested (of {counts['pairs']})"
        )
    assert counts["untested"] == 0
    assert counts["tested"] + counts["refused"] == counts["pairs"] == len(table.OPTIONS) * (len(table.OPTIONS) - 1) // 2
    for a, b in table.REFUSED:
        assert (a, b) == table.pair(a, b) and not table.tests_of(a, b), (a, b)  # no test runs a refused pair
    assert set(SPELLINGS) == set(table.OPTIONS)
    for test in table.TESTS:
        assert test.options <= set(table.OPTIONS) and len(test.options) >= 2, test.node


@cache
def _parsed(path: Path) -> tuple[str, ast.Module]:
    text = path.read_text()
    return text, ast.parse(text)


def _test_source(node: str) -> str:
    """The test's module without its other tests: the test itself, and the constants, fixtures and
    helpers it may take its options from."""
    path, _, name = node.partition("::")
    name, _, param = name.partition("[")
    text, module = _parsed(REPO / path)
    tests = {n.name: n for n in module.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    assert name in tests, f"{node}: no test {name} in {path}"
    if param:
        assert f'"{param.rstrip("]")}"' in text, f"{node}: {path} has no parameter {param.rstrip(']')}"
    lines = text.splitlines()
    for other in tests.values():
        if other.name != name:
            start = min([other.lineno, *(d.lineno for d in other.decorator_list)])
            lines[start - 1 : other.end_lineno] = [""] * (other.end_lineno - start + 1)
    return "\n".join(lines)


@pytest.mark.parametrize("test", table.TESTS, ids=[t.node.rpartition("::")[2] for t in table.TESTS])
def test_named_tests_exist_and_turn_their_options_on(test):
    source = _test_source(test.node)
    for key in sorted(test.options):
        assert any(s in source for s in SPELLINGS[key]), f"{test.node} never turns {key} on"


def _options(*keys: str, monkeypatch) -> tuple[TrainOptions, int]:
    """Options with `keys` on, as their examples turn them on, and the ranks they run on (set as
    torchrun sets them)."""
    values = {}
    for key in keys:
        values.update(table.OPTIONS[key].example)
    ranks = values.pop("ranks", 1)
    monkeypatch.setenv("WORLD_SIZE", str(ranks))
    return TrainOptions.from_dict(values), ranks


@pytest.mark.parametrize("pair", list(table.REFUSED), ids="-".join)
def test_refused_pairs_are_refused_with_their_reason(pair, monkeypatch):
    options, _ = _options(*pair, monkeypatch=monkeypatch)
    with pytest.raises(UserError) as refused:
        options.validate()
    assert str(refused.value) == table.REFUSED[pair]
    for key in pair:  # each alone is fine
        _options(key, monkeypatch=monkeypatch)[0].validate()


def test_every_other_pair_passes_validation(monkeypatch):
    for a, b in table.pairs():
        if (a, b) not in table.REFUSED:
            options, ranks = _options(a, b, monkeypatch=monkeypatch)
            options.validate()
            assert table.OPTIONS[a].on(options, ranks) and table.OPTIONS[b].on(options, ranks), (a, b)


def test_the_doc_holds_the_generated_table():
    assert table.documented() == table.markdown(), (
        "docs/grpo.md §7 is stale: python -m ouro_cli.rl.combinations --write"
    )
