"""Which options of `ouro train` combine: one table, enforced here, generated into docs/grpo.md §7.

`OPTIONS` lists every option that changes what a run trains or how it samples. For every
pair of them exactly one of two things holds:

- a named test runs the two together and checks a property that fails if the pair does
  not work (`TESTS`: a test runs a set of options at once, so it covers every pair of the
  set);
- the pair is refused (`REFUSED`): `check`, which TrainOptions.validate calls before any
  model loads, raises the pair's one-line reason as a UserError (exit 2).

tests/unit/rl/test_combinations.py holds the table to that: every pair classified, every
named test present and spelling the options it claims, every refused pair refused with its
reason, every other pair accepted, and docs/grpo.md §7 equal to `markdown()`.

    python -m ouro_cli.rl.combinations            # print the table as docs/grpo.md §7 holds it
    python -m ouro_cli.rl.combinations --write    # rewrite that section of docs/grpo.md
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ouro_cli.errors import UserError


@dataclass(frozen=True)
class Option:
    flag: str  # how the table names it
    on: Callable[[Any, int], bool]  # whether a run of these TrainOptions on this many ranks uses it
    example: dict[str, Any]  # flat option values that turn it on (`ranks`: the ranks it needs)


OPTIONS: dict[str, Option] = {
    "advantage": Option("--advantage dr-grpo|rloo", lambda o, ranks: o.advantage != "grpo", {"advantage": "rloo"}),
    "steps": Option(
        "--mini-batches N / --epochs E, N·E > 1", lambda o, ranks: o.optimizer_steps_per_update > 1, {"mini_batches": 2}
    ),
    "is": Option(
        "--is-correction tis|mis|geo-mask", lambda o, ranks: o.trainer.is_correction != "none", {"is_correction": "tis"}
    ),
    "clip-c": Option("--clip-ratio-c C", lambda o, ranks: o.trainer.clip_ratio_c is not None, {"clip_ratio_c": 3.0}),
    "exact": Option("--exact", lambda o, ranks: o.execution.exact, {"exact": True}),
    "fp8": Option("--kv-cache-dtype fp8", lambda o, ranks: o.execution.fp8_kv, {"kv_cache_dtype": "fp8"}),
    "loops": Option(
        "--loop-weighting uniform|progressive|exit-pdf",
        lambda o, ranks: o.trainer.loop_weighting != "exit",
        {"loop_weighting": "uniform"},
    ),
    "filter": Option("--filter-groups", lambda o, ranks: o.filter_groups, {"filter_groups": True}),
    "overlong": Option("--overlong mask|soft", lambda o, ranks: o.overlong != "none", {"overlong": "mask"}),
    "threshold": Option(
        "--exit-threshold < 1", lambda o, ranks: o.sampling.exit_threshold < 1, {"exit_threshold": 0.7}
    ),
    "async": Option("--async-scheduling", lambda o, ranks: o.engine.async_scheduling, {"async_scheduling": True}),
    "spec": Option(
        "--speculative-tokens N (--depths T)",
        lambda o, ranks: o.engine.speculative_tokens > 0,
        {"speculative_tokens": 2, "depths": [4]},
    ),
    "pd": Option(
        "--prefill-devices / --decode-devices",
        lambda o, ranks: o.engine.disaggregated,
        {"prefill_devices": [0], "decode_devices": [1]},
    ),
    "ranks": Option("torchrun, 2 or more ranks", lambda o, ranks: ranks > 1, {"ranks": 2}),
    # auto counts: it moves the state where the memory plan gains by it, which a run cannot know up front
    "offload": Option(
        "--offload-optimizer on|auto",
        lambda o, ranks: o.trainer.offload_optimizer != "off",
        {"offload_optimizer": "on"},
    ),
}


def pair(a: str, b: str) -> tuple[str, str]:
    """The pair in table order."""
    order = list(OPTIONS)
    return (a, b) if order.index(a) < order.index(b) else (b, a)


REFUSED: dict[tuple[str, str], str] = {
    pair("async", "spec"): "--speculative-tokens needs synchronous scheduling; drop --async-scheduling",
    pair("threshold", "spec"): "--speculative-tokens needs --exit-threshold 1: drafts are verified at full depth",
    pair("spec", "pd"): "--prefill-devices/--decode-devices do not run with --speculative-tokens: the PD engine "
    "does not run self-speculation",
    pair("async", "pd"): "--prefill-devices/--decode-devices do not run with --async-scheduling: the PD engine's "
    "decode workers schedule synchronously",
    pair("pd", "ranks"): "--prefill-devices/--decode-devices place one engine's workers; under torchrun every rank "
    "would start its own on the same devices: run PD with one rank",
}


@dataclass(frozen=True)
class Test:
    node: str  # pytest node id
    shows: str  # what it checks, which fails if its options do not work together
    options: frozenset[str]


def _test(node: str, shows: str, *options: str) -> Test:
    return Test(node, shows, frozenset(options))


TRAINED = ("advantage", "steps", "is", "clip-c", "loops", "filter", "overlong")  # the loss and the data it sees
TESTS: list[Test] = [
    _test(
        "tests/unit/trainer/test_is_multi_step.py::test_two_mini_batches_two_epochs_by_hand",
        "each step's loss, clip fraction and largest ratio equal a hand computation; the clip is active after step 1",
        "steps",
        "is",
        "clip-c",
        "loops",
    ),
    _test(
        "tests/integration/test_grpo_options.py::test_filtered_masked_mini_batched_updates_account_for_every_group",
        "every drawn group is filtered, masked or trained as its rewards say; advantages by hand",
        "advantage",
        "steps",
        "loops",
        "filter",
        "overlong",
    ),
    _test(
        "tests/integration/test_verify_resume_cli.py::test_mini_batches_and_filtered_refills_resume_bit_identically",
        "a fresh-process resume repeats the continuous run bit for bit",
        *TRAINED,
        "threshold",
        "offload",
    ),
    _test(
        "tests/integration/test_grpo_options.py::test_two_ranks_filter_refill_and_split_as_one_rank_does",
        "two ranks draw, filter, sample and train what one rank does",
        *TRAINED,
        "fp8",
        "threshold",
        "async",
        "ranks",
        "offload",
    ),
    _test(
        "tests/integration/test_train_modes.py::test_async_scheduling_trains_on_replayable_delayed_exits",
        "the trainer replays the delayed exits the engine sampled (logprob mismatch < 1e-5)",
        *TRAINED,
        "threshold",
        "async",
        "offload",
    ),
    _test(
        "tests/integration/test_train_modes.py::test_speculative_training_runs_at_full_depth",
        "every token is verified at full depth and the replay agrees with the engine (< 1e-5)",
        *TRAINED,
        "spec",
        "offload",
    ),
    _test(
        "tests/integration/test_train_pd.py::test_train_with_pd_workers_matches_the_local_engine",
        "PD workers sample what the local engine samples, over updates trained in between",
        *TRAINED,
        "threshold",
        "pd",
        "offload",
    ),
    _test(
        "tests/integration/test_exact_train.py::test_exact_runs_have_no_mismatch_at_all[exact-fp32]",
        "engine and trainer logprobs are equal (mismatch exactly 0, IS weights exactly 1); the clip is active "
        "at the second step",
        "advantage",
        "steps",
        "is",
        "clip-c",
        "loops",
        "overlong",
        "exact",
        "threshold",
        "offload",
    ),
    _test(
        "tests/integration/test_exact_train.py::test_exact_runs_have_no_mismatch_at_all[exact-fp8]",
        "with an fp8 KV cache on PD workers, engine and trainer logprobs are equal (mismatch exactly 0, IS "
        "weights exactly 1); the plan records the cache and the export notes it",
        "advantage",
        "steps",
        "is",
        "clip-c",
        "exact",
        "fp8",
        "loops",
        "overlong",
        "threshold",
        "pd",
        "offload",
    ),
    _test(
        "tests/unit/engine/test_speculative.py::test_speculation_with_an_fp8_cache_matches_the_replay",
        "drafts and their verification in the fp8 cache: logprobs the replay's, planes the rounded dense K/V",
        "fp8",
        "spec",
    ),
    _test(
        "tests/integration/test_exact_train.py::test_exact_runs_have_no_mismatch_at_all[exact-pd]",
        "engine and trainer logprobs are equal (mismatch exactly 0)",
        "exact",
        "threshold",
        "pd",
    ),
    _test(
        "tests/integration/test_exact_train.py::test_verify_resume_is_bit_identical_in_exact_mode",
        "a fresh-process resume repeats the continuous run bit for bit; mismatch exactly 0",
        "steps",
        "filter",
        "exact",
        "threshold",
        "async",
    ),
    _test(
        "tests/integration/test_train_ranks.py::test_two_ranks_match_one_rank_and_ouro_compare_judges_the_pair",
        "two ranks sample what one rank samples; weights equal to fp32 reduction order; mismatch exactly 0",
        "ranks",
        "spec",
        "exact",
    ),
]


def pairs() -> list[tuple[str, str]]:
    return list(itertools.combinations(OPTIONS, 2))


def tests_of(a: str, b: str) -> list[Test]:
    return [t for t in TESTS if {a, b} <= t.options]


def counts() -> dict[str, int]:
    """Pairs tested, refused, and neither."""
    tested = sum(bool(tests_of(a, b)) for a, b in pairs())
    refused = sum(p in REFUSED for p in pairs())
    return {
        "pairs": len(pairs()),
        "tested": tested,
        "refused": refused,
        "untested": sum(not tests_of(a, b) and (a, b) not in REFUSED for a, b in pairs()),
    }


def check(options, ranks: int) -> None:
    """Refuse a run that uses a refused pair (TrainOptions `options` on `ranks` ranks), naming it."""
    used = [key for key, option in OPTIONS.items() if option.on(options, ranks)]
    for a, b in itertools.combinations(used, 2):
        if (a, b) in REFUSED:
            raise UserError(REFUSED[(a, b)])


# ---- docs/grpo.md §7 --------------------------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "grpo.md"
BEGIN = "<!-- combinations: generated by `python -m ouro_cli.rl.combinations --write`; do not edit -->"
END = "<!-- end of combinations -->"


def markdown() -> str:
    """The table as docs/grpo.md §7 holds it, between BEGIN and END."""
    number = {t.node: i for i, t in enumerate(TESTS, 1)}
    keys = list(OPTIONS)
    c = counts()
    lines = [
        BEGIN,
        "",
        f"{c['pairs']} pairs of {len(keys)} options: {c['tested']} tested, {c['refused']} refused, "
        f"{c['untested']} untested.",
        "",
        "| option | flags |",
        "|---|---|",
    ]
    lines += [f"| `{key}` | `{_cell(option.flag)}` |" for key, option in OPTIONS.items()]
    lines += [
        "",
        "Each cell: the tests below that run the two options together, or ✗ refused.",
        "",
        "| | " + " | ".join(f"`{k}`" for k in keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for a in keys:
        cells = []
        for b in keys:
            if a == b:
                cells.append("")
            elif pair(a, b) in REFUSED:
                cells.append("✗")
            else:
                cells.append(" ".join(str(number[t.node]) for t in tests_of(a, b)))
        lines.append(f"| `{a}` | " + " | ".join(cells) + " |")
    lines += ["", "Tests (each runs its options together and checks what it shows):", ""]
    lines += [
        f"{number[t.node]}. `{t.node}`: {t.shows}. Options: "
        + ", ".join(f"`{k}`" for k in keys if k in t.options)
        + "."
        for t in TESTS
    ]
    lines += ["", "Refused, before any model loads (exit 2):", ""]
    lines += [f"- `{a}` × `{b}`: {reason}" for (a, b), reason in REFUSED.items()]
    return "\n".join([*lines, "", END])


def _cell(text: str) -> str:
    """`text` inside a Markdown table cell (a pipe would end the cell)."""
    return text.replace("|", "\\|")


def write_doc(path: Path = DOC) -> bool:
    """Replace the generated section of `path`; whether it changed."""
    text = path.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + markdown() + text[stop:]
    path.write_text(new)
    return new != text


def documented(path: Path = DOC) -> str:
    """The generated section as `path` holds it."""
    text = path.read_text()
    return text[text.index(BEGIN) : text.index(END) + len(END)]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        print(f"{DOC}: {'rewritten' if write_doc() else 'unchanged'}")
    else:
        print(markdown())
