"""Multi-sample evaluation (rl/evaluate.py): the pass@k estimator, the seeds, the records.

- `pass_at_k` against hand computations, against enumerating every k-subset of n samples
  (small n), and against exact binomials in rationals (large n, where a float binomial
  would overflow).
- One sample per prompt sends exactly the requests, and returns exactly the fields, that
  the one-sample evaluation always did; N samples seed each (prompt, sample) on its own,
  sample 0 as before, and the first samples of a larger N are those of a smaller N.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from types import SimpleNamespace

import pytest

from ouro_cli.rl.data import Row
from ouro_cli.rl.evaluate import eval_seed, evaluate, pass_at_k, pass_ks
from ouro_cli.rl.rollout import RolloutSampling, generate_groups, request_seed

T = 4


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (6, 1, 3, 0.5),  # 1 - C(5,3)/C(6,3) = 1 - 10/20
        (8, 3, 4, 13 / 14),  # 1 - C(5,4)/C(8,4) = 1 - 5/70
        (10, 0, 5, 0.0),  # nothing passed
        (3, 2, 2, 1.0),  # n - c < k: every pair holds a pass
        (4, 4, 1, 1.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))  # samples 0 .. c-1 passed
                share = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(share, abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_pass_rate_and_large_n_stays_exact():
    assert all(pass_at_k(16, c, 1) == pytest.approx(c / 16, abs=1e-15) for c in range(17))
    for n, c, k in ((1000, 1, 500), (1000, 3, 64), (2000, 1500, 1000), (512, 37, 256)):
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)
        assert 0.0 <= pass_at_k(n, c, k) <= 1.0


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def test_pass_ks_are_powers_of_two_up_to_n():
    assert [pass_ks(n) for n in (1, 2, 3, 4, 6, 8, 17)] == [
        [1],
        [1, 2],
        [1, 2],
        [1, 2, 4],
        [1, 2, 4],
        [1, 2, 4, 8],
        [1, 2, 4, 8, 16],
    ]


def test_sample_zero_keeps_the_one_sample_seed():
    assert eval_seed(1234, 7, 0) == request_seed(1234, 0, 7, "eval") == 549682632383915728  # test_ranks.py's pin
    seeds = {eval_seed(1234, i, s) for i in range(50) for s in range(50)}
    assert len(seeds) == 2500


class SeedEngine:
    """Answers "yes" when a request's seed is odd, "no" otherwise, with a length that depends
    on the seed, and keeps the sampling parameters it got."""

    def __init__(self) -> None:
        self.seen = []

    def get_weight_version(self) -> int:
        return 0

    def generate(self, prompts, params):
        self.seen.extend(params)
        outputs = []
        for i, p in enumerate(params):
            n = 1 + p.seed % 3
            outputs.append(
                SimpleNamespace(
                    request_id=str(i),
                    output_token_ids=[p.seed % 2] * n,
                    exit_depths=[T] + [p.max_loops] * (n - 1),
                    log_probs=[-0.5] * n,
                    finish_reason="length" if n == 3 else "stop",
                    weight_version=0,
                    sampling_params=p,
                )
            )
        return outputs


ROWS = [Row(index=i, line=i + 1, prompt=f"q{i}", label=None, problem_id=f"p{i}") for i in range(5)]
SAMPLING = RolloutSampling(
    num_loops=T,
    seed=1234,
    temperature=1.0,
    max_tokens=3,
    exit_threshold=1.0,
    min_loops=1,
    stop_token_ids=(0,),
    decode=lambda ids: "yes" if ids[0] else "no",
)


def reward(text, label, metadata):
    return float(text == "yes")


def _evaluate(samples, responses=None):
    engine = SeedEngine()
    results = evaluate(
        engine, ROWS, [[1, 2]] * len(ROWS), SAMPLING, ks=[2, 4], reward_fn=reward, samples=samples, responses=responses
    )
    return results, engine.seen


def test_one_sample_sends_the_one_sample_requests_and_reports_the_same_fields():
    results, seen = _evaluate(1)
    engine, today = SeedEngine(), []
    for k in (2, 4):  # the one-sample evaluation as it always ran, written out
        drawn = generate_groups(
            engine, ROWS, [[1, 2]] * len(ROWS), SAMPLING, group_size=1, k=k, update=0, purpose="eval"
        )
        rewards = [reward(s.text, None, {}) for s in drawn]
        depths = [d for s in drawn for d in s.exit_depths[1:]]
        today.append(
            {
                "k": k,
                "prompts": len(drawn),
                "accuracy": sum(rewards) / len(rewards),
                "mean_exit_depth": sum(depths) / len(depths),
                "mean_tokens": sum(len(s.response_ids) for s in drawn) / len(drawn),
                "truncated": sum(s.finish_reason == "length" for s in drawn),
            }
        )
    assert seen == engine.seen
    assert results == today


def test_n_samples_are_seeded_per_prompt_and_sample_and_summarised():
    responses = []
    results, seen = _evaluate(4, responses)
    assert [p.seed for p in seen] == [eval_seed(1234, i, s) for _ in (2, 4) for i in range(5) for s in range(4)]
    assert [p.max_loops for p in seen] == [2] * 20 + [4] * 20
    assert len(responses) == 2 * 5 * 4
    assert [(r["k"], r["problem_id"], r["sample"]) for r in responses] == [
        (k, f"p{i}", s) for k in (2, 4) for i in range(5) for s in range(4)
    ]
    for result in results:
        mine = [r for r in responses if r["k"] == result["k"]]
        passed = [sum(r["reward"] > 0 for r in mine if r["problem_id"] == f"p{i}") for i in range(5)]
        assert result["samples"] == 4 and result["prompts"] == 5
        assert result["accuracy"] == result["avg@4"] == sum(r["reward"] for r in mine) / 20
        assert result["pass@1"] == pytest.approx(result["accuracy"], abs=1e-12)
        assert result["pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in passed) / 5, abs=1e-15)
        assert result["pass@4"] == sum(c > 0 for c in passed) / 5
        assert result["pass@1"] <= result["pass@2"] <= result["pass@4"]
        assert result["truncated"] == sum(r["truncated"] for r in mine)
        assert result["mean_tokens"] == sum(r["tokens"] for r in mine) / 20
    first = responses[0]
    assert first["seed"] == eval_seed(1234, 0, 0) and first["text"] in ("yes", "no")
    assert first["mean_exit_depth"] == (2.0 if first["tokens"] > 1 else None)  # None: the prefill's token only

    two = []
    _evaluate(2, two)
    assert two == [r for r in responses if r["sample"] < 2]  # a larger N extends a smaller one


def test_eval_samples_may_change_on_resume_and_must_be_positive():
    from ouro_cli.errors import UserError
    from ouro_cli.rl import plan as plans
    from ouro_cli.rl.options import TrainOptions

    def contract(options):
        return plans.build_contract(
            options,
            data_sha256="d" * 64,
            model_config={"x": 1},
            tokenizer_sha256=None,
            template={"name": "chatml"},
            num_loops=T,
        )

    saved = contract(TrainOptions())
    assert "eval_samples" not in saved
    plans.check_same_contract(saved, contract(TrainOptions(eval_samples=8)), allow_scheduler=False)
    with pytest.raises(UserError, match="^--eval-samples must be at least 1, got 0$"):
        TrainOptions(eval_samples=0).validate()


def test_a_reward_that_is_not_a_number_is_one_line_naming_the_function_and_problem():
    import numpy as np

    from ouro_cli.errors import CheckFailed

    def array_reward(text, label, metadata):
        return np.array([1.0, 2.0])

    with pytest.raises(CheckFailed) as err:
        evaluate(
            SeedEngine(),
            ROWS,
            [[1, 2]] * len(ROWS),
            SAMPLING,
            ks=[2],
            reward_fn=array_reward,
            where="evaluation at update 0",
        )
    assert str(err.value) == (
        "evaluation at update 0, K=2: reward function tests.unit.rl.test_evaluate."
        "test_a_reward_that_is_not_a_number_is_one_line_naming_the_function_and_problem.<locals>.array_reward "
        "returned array([1., 2.]) (ndarray), not a number for problem_id 'p0'; a reward must be a finite real "
        "number (bool, int or float)"
    )
