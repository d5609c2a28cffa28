"""`ouro eval --samples N` on the bundled tiny model (CPU): avg@N, pass@k and responses.jsonl.

- Without `--samples` (N = 1) the results are the one-sample evaluation's, bit for bit: the
  reference here runs that evaluation in this process as it always ran (one request per
  prompt through `generate_groups`, seeded by the prompt's position) and computes its
  figures from the samples.
- With N = 4, pass@1 equals avg@N (0/1 rewards), pass@k grows with k, sample 0 of every
  prompt is the one-sample evaluation's response, and responses.jsonl has one line per
  (K, prompt, sample).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ouro_cli.bundled import TINY

from .test_eval_cli import ouro

PROMPTS = 8
DEPTHS = [1, 4]
COMMON = [
    "--data",
    str(TINY / "eval.jsonl"),
    "--depths",
    *map(str, DEPTHS),
    "--prompts",
    str(PROMPTS),
    "--device",
    "cpu",
    "--json",
]


@pytest.fixture(scope="module")
def evals(tmp_path_factory) -> dict[int, tuple[dict, Path]]:
    """N -> (the --json document, the output directory), for N = 1 (flag left out) and 4."""
    root = tmp_path_factory.mktemp("eval-samples")
    done = {}
    for n, extra in ((1, []), (4, ["--samples", "4"])):
        proc = ouro("eval", str(TINY / "model"), *COMMON, *extra, "--out", str(root / f"n{n}"), cwd=root)
        assert proc.returncode == 0, proc.stderr
        done[n] = json.loads(proc.stdout), root / f"n{n}"
    return done


def _responses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]


def _one_sample_reference() -> tuple[list[dict], list[str]]:
    """The one-sample evaluation of the first PROMPTS rows, run as it always ran: (its
    results per K, every response text in (K, prompt) order)."""
    from ouro_cli.checkpoint import open_checkpoint
    from ouro_cli.engine import LLM
    from ouro_cli.engine.tokenizer import TextCodec
    from ouro_cli.mcore import single_process_group
    from ouro_cli.model import from_state_dict
    from ouro_cli.rl.data import Columns, load_dataset
    from ouro_cli.rl.options import EvalOptions
    from ouro_cli.rl.prompts import stop_tokens_for, tokenize_prompts
    from ouro_cli.rl.rewards import load_reward
    from ouro_cli.rl.rollout import RolloutSampling, generate_groups
    from ouro_cli.rl.template import get_template

    defaults = EvalOptions(model=str(TINY / "model"), data=str(TINY / "eval.jsonl")).validate()
    rows = load_dataset(TINY / "eval.jsonl", Columns())[:PROMPTS]
    reward = load_reward(defaults.task.reward_function)
    with single_process_group():
        source = open_checkpoint(TINY / "model")
        codec = TextCodec.from_dir(source.assets_dir)
        ids = tokenize_prompts(
            codec,
            get_template("chatml"),
            rows,
            source.config.max_position_embeddings,
            defaults.sampling.max_response_len,
            "eval.jsonl",
        )
        net = from_state_dict(source.config, dict(source.iter_tensors()), device="cpu")
    sampling = RolloutSampling.of(
        defaults.sampling,
        num_loops=source.config.num_loops,
        seed=defaults.seed,
        stop_token_ids=stop_tokens_for(source.config, codec),
        decode=codec.decode,
    )
    engine = LLM(net, max_num_seqs=defaults.max_num_seqs, execution=defaults.execution)
    results, texts = [], []
    try:
        for k in DEPTHS:
            drawn = generate_groups(engine, rows, ids, sampling, group_size=1, k=k, update=0, purpose="eval")
            rewards = [float(reward(s.text, s.row.label, s.row.metadata)) for s in drawn]
            depths = [d for s in drawn for d in s.exit_depths[1:]]
            results.append(
                {
                    "k": k,
                    "prompts": len(drawn),
                    "accuracy": sum(rewards) / len(rewards),
                    "mean_exit_depth": sum(depths) / len(depths),
                    "mean_tokens": sum(len(s.response_ids) for s in drawn) / len(drawn),
                    "truncated": sum(s.finish_reason == "length" for s in drawn),
                }
            )
            texts += [s.text for s in drawn]
    finally:
        engine.close()
    return results, texts


def test_one_sample_is_the_one_sample_evaluation_bit_for_bit(evals):
    document, out = evals[1]
    results, texts = _one_sample_reference()
    assert document["evaluations"] == results
    assert [
        {k: v for k, v in json.loads(line).items() if k != "model"}
        for line in (out / "evaluations.jsonl").read_text().splitlines()
    ] == results
    responses = _responses(out)
    assert [(r["k"], r["sample"]) for r in responses] == [(k, 0) for k in DEPTHS for _ in range(PROMPTS)]
    assert [r["text"] for r in responses] == texts
    assert document["responses"] == str(out / "responses.jsonl")


def test_four_samples_report_avg_and_pass_at_k(evals):
    document, out = evals[4]
    assert (out / "COMPLETE").is_file() and not list(out.parent.glob(f".{out.name}.staging-*"))
    responses = _responses(out)
    assert len(responses) == len(DEPTHS) * PROMPTS * 4
    assert [(r["k"], r["sample"]) for r in responses] == [
        (k, s) for k in DEPTHS for _ in range(PROMPTS) for s in range(4)
    ]
    rows = [json.loads(line) for line in (TINY / "eval.jsonl").read_text().splitlines()]
    labels = {r["metadata"]["problem_id"]: r["label"] for r in rows}
    for r in responses:
        assert set(r) == {
            "problem_id",
            "label",
            "k",
            "sample",
            "seed",
            "text",
            "reward",
            "mean_exit_depth",
            "tokens",
            "truncated",
        }
        assert r["label"] == labels[r["problem_id"]]
        assert r["mean_exit_depth"] in (None, float(r["k"]))  # exit threshold 1: every decoded token runs K loops
    ones = _responses(evals[1][1])
    assert [r for r in responses if r["sample"] == 0] == ones  # sample 0 is the one-sample evaluation's
    assert json.loads((out / "manifest.json").read_text())["options"]["samples"] == 4
    for result in document["evaluations"]:
        mine = [r for r in responses if r["k"] == result["k"]]
        assert result["samples"] == 4 and result["prompts"] == PROMPTS
        assert result["accuracy"] == result["avg@4"] == sum(r["reward"] for r in mine) / len(mine)
        assert result["pass@1"] == pytest.approx(result["avg@4"], abs=1e-12)
        assert result["pass@1"] <= result["pass@2"] <= result["pass@4"]
        solved = {r["problem_id"] for r in mine if r["reward"] > 0}
        assert result["pass@4"] == len(solved) / PROMPTS
    assert any(r["pass@2"] > r["pass@1"] for r in document["evaluations"])  # the samples do differ


def test_samples_below_one_is_a_usage_error(tmp_path):
    proc = ouro("eval", str(TINY / "model"), *COMMON, "--samples", "0", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "--samples must be at least 1, got 0" in proc.stderr and not (tmp_path / "out").exists()
