"""The GRPO options of `ouro train` end to end (docs/grpo.md): what each update drew, filtered,
masked and trained is in its metrics line and its rollout records, and they agree."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .test_train_cli import ouro
from .tiny_checkpoint import BINARY_REWARD, make_checkpoint

P, G, L = 3, 3, 6


def _train(root: Path, run: str, *options: str) -> tuple[list[dict], list[list[dict]], dict]:
    make_checkpoint(root)
    proc = ouro(
        "train",
        "--model",
        str(root / "hf"),
        "--data",
        str(root / "train.jsonl"),
        "--eval-data",
        "",
        "--prompts-per-update",
        str(P),
        "--group-size",
        str(G),
        "--max-response-len",
        str(L),
        "--depths",
        "2",
        "4",
        "--updates",
        "3",
        "--reward-function",
        BINARY_REWARD,
        "--run-dir",
        str(root / run),
        *options,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    metrics = [json.loads(x) for x in (root / run / "metrics.jsonl").read_text().splitlines()]
    records = [
        [json.loads(x) for x in (root / run / "rollouts" / f"update_{u:06d}.jsonl").read_text().splitlines()]
        for u in range(3)
    ]
    return metrics, records, json.loads((root / run / "ouro-plan.json").read_text())["contract"]


def test_filtered_masked_mini_batched_updates_account_for_every_group(tmp_path):
    metrics, records, contract = _train(
        tmp_path,
        "run",
        "--filter-groups",
        "--max-refill",
        "2",
        "--overlong",
        "mask",
        "--mini-batches",
        "2",
        "--epochs",
        "2",
        "--loop-weighting",
        "exit-pdf",
        "--advantage",
        "dr-grpo",
    )
    assert (
        contract["filter_groups"],
        contract["max_refill"],
        contract["overlong"],
        contract["mini_batches"],
        contract["epochs"],
        contract["loop_weighting"],
        contract["advantage"],
    ) == (True, 2, "mask", 2, 2, "exit-pdf", "dr-grpo")
    for m, rows in zip(metrics, records, strict=True):
        groups = defaultdict(list)
        for r in rows:
            groups[r["group"]].append(r)
        assert m["prompts_drawn"] == len(groups) <= P + 2 and len(rows) == G * len(groups)
        assert sorted(groups) == list(range(m["prompts_drawn"]))  # refill rounds take the next positions
        constant = [g for g, rs in groups.items() if len({r["reward"] for r in rs}) == 1]
        assert m["groups_filtered"] == len(constant)
        signal = sorted(set(groups) - set(constant))
        assert m["groups_trained"] == min(P, len(signal))
        assert m["refill_exhausted"] == (m["groups_trained"] < P)
        chosen = signal[:P]
        for g, rs in groups.items():
            for r in rs:  # trained: a chosen group's response that was not truncated
                assert r["trained"] == (g in chosen and r["finish_reason"] != "length"), (g, r)
            mean = sum(r["reward"] for r in rs) / G  # dr-grpo: r − mean, no std
            assert all(abs(r["advantage"] - (r["reward"] - mean)) < 1e-12 for r in rs)
        trained = [r for r in rows if r["trained"]]
        assert m["train_overlong_masked"] == sum(r["finish_reason"] == "length" for g in chosen for r in groups[g])
        assert m["train_samples"] == len(trained)
        assert m["train_optimizer_steps"] + m["train_empty_mini_batches"] == 4  # 2 mini-batches × 2 epochs
        if trained:
            assert len(m["train_loop_logprob_mean"]) == 4 and m["train_loop_tokens"][0] > 0


def test_soft_overlong_penalty_shapes_the_advantage_not_the_reward(tmp_path):
    metrics, records, contract = _train(
        tmp_path,
        "run",
        "--overlong",
        "soft",
        "--overlong-buffer",
        "2",
        "--advantage",
        "rloo",
        "--loop-weighting",
        "progressive",
        "--loop-weight-alpha",
        "2",
    )
    assert (contract["overlong"], contract["overlong_buffer"], contract["loop_weight_alpha"]) == ("soft", 2, 2.0)
    for m, rows in zip(metrics, records, strict=True):
        assert m["groups_trained"] == m["prompts_drawn"] == P and all(r["trained"] for r in rows)
        assert m["truncations"] == sum(r["finish_reason"] == "length" for r in rows)
        for r in rows:  # buffer 2 of 6 tokens: free up to 4, −0.5 at 5, −1 at 6
            assert r["length_penalty"] == {5: -0.5, 6: -1.0}.get(len(r["response_ids"]), 0.0)
        for g in range(P):
            shaped = [r["reward"] + r["length_penalty"] for r in rows if r["group"] == g]
            got = [r["advantage"] for r in rows if r["group"] == g]
            expected = [x - (sum(shaped) - x) / (G - 1) for x in shaped]  # leave-one-out
            assert all(abs(a - b) < 1e-12 for a, b in zip(got, expected, strict=True))
        assert m["train_optimizer_steps"] == 1 and len(m["train_loop_logprob_mean"]) == 4


def test_two_ranks_filter_refill_and_split_as_one_rank_does(tmp_path):
    """Refill rounds and mini-batches depend on batch positions and rewards only: two gloo ranks
    draw, filter, refill and train the same groups as one rank, and keep bit-identical replicas,
    through a refill round of one prompt (one rank draws nothing), a spent budget, and steps in
    which one rank holds no sample or no rank does; with every option of the loss on (each rank
    takes its samples' first-policy logprobs under `--is-correction` and several steps),
    asynchronous threshold exits, an fp8 KV cache and the optimizer state offloaded between
    steps."""
    import os
    import subprocess
    import sys

    from .test_train_cli import REPO

    make_checkpoint(tmp_path)
    flags = [
        "train",
        "--model",
        str(tmp_path / "hf"),
        "--data",
        str(tmp_path / "train.jsonl"),
        "--eval-data",
        "",
        "--prompts-per-update",
        "4",
        "--group-size",
        "3",
        "--max-response-len",
        "6",
        "--depths",
        "2",
        "4",
        "--updates",
        "2",
        "--save-interval",
        "0",
        "--reward-function",
        BINARY_REWARD,
        "--filter-groups",
        "--max-refill",
        "1",
        "--mini-batches",
        "3",  # a refill round of one prompt: rank 1 draws none
        "--epochs",
        "2",
        "--advantage",
        "rloo",
        "--overlong",
        "soft",
        "--is-correction",
        "tis",
        "--clip-ratio-c",
        "3",
        "--loop-weighting",
        "uniform",
        "--exit-threshold",
        "0.5",
        "--async-scheduling",
        "--kv-cache-dtype",
        "fp8",
        "--offload-optimizer",
        "on",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ouro_cli.cli.app",
            *flags,
            "--run-dir",
            str(tmp_path / "two"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-4000:]
    one = ouro(*flags, "--run-dir", str(tmp_path / "one"), cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    lines = {
        n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("one", "two")
    }
    keys = (
        "prompts_drawn",
        "groups_filtered",
        "groups_trained",
        "refill_rounds",
        "train_optimizer_steps",
        "train_empty_mini_batches",
        "train_samples",
        "train_response_tokens",
    )
    assert [[m[k] for k in keys] for m in lines["one"]] == [[m[k] for k in keys] for m in lines["two"]]
    assert sum(m["refill_rounds"] for m in lines["one"]) > 0 and any(m["refill_exhausted"] for m in lines["one"])
    assert all(m["params_identical_across_ranks"] for m in lines["two"])
    plans = [json.loads((tmp_path / n / "ouro-plan.json").read_text()) for n in ("one", "two")]
    assert [p["contract"]["execution"]["kv_cache_dtype"] for p in plans] == ["fp8", "fp8"]
    for update in range(2):
        name = f"update_{update:06d}.jsonl"
        a, b = (
            [json.loads(x) for x in (tmp_path / n / "rollouts" / name).read_text().splitlines()] for n in ("one", "two")
        )
        fields = ("group", "problem_id", "seed", "response_ids", "reward", "advantage", "trained")
        assert [[r[f] for f in fields] for r in a] == [[r[f] for f in fields] for r in b]
