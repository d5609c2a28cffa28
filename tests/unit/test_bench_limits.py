"""bench/e2e_limits.py's rollout roofline: K planes of every decoded token's context, a shared
prompt counted once per group for as long as its longest sample decodes, an fp8 row's bytes."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import e2e_limits  # noqa: E402

CONFIG = SimpleNamespace(
    num_hidden_layers=2,
    num_key_value_heads=2,
    num_attention_heads=4,
    dim_per_head=128,
    hidden_size=256,
    intermediate_size=512,
    vocab_size=1000,
)
PLANE_BF16 = 2 * 2 * 2 * 128 * 2  # K and V, layers, heads, head_dim, bytes


def record(lengths, prompt=10, k=4):
    return {
        "k": k,
        "response_lengths": lengths,
        "rank_samples": [len(lengths)],
        "engine_prefill_tokens": prompt * len(lengths),
    }


def test_each_sample_reads_its_prompt_and_own_tokens_without_sharing():
    lengths = [3, 5, 2, 7]
    r = record(lengths)
    weights = max(lengths) * (4 * e2e_limits.layer_stack_params(CONFIG) + 1000 * 256) * 2
    context = sum(10 * n + n * (n - 1) / 2 for n in lengths)
    assert e2e_limits.rollout_limit_s(r, CONFIG) * e2e_limits.COPY_BANDWIDTH == pytest.approx(
        context * 4 * PLANE_BF16 + weights
    )


@pytest.mark.parametrize("fp8", [False, True])
def test_a_shared_prompt_counts_once_per_group_for_its_longest_sample(fp8):
    lengths = [3, 5, 2, 7]  # two groups of two: longest 5 and 7
    r = record(lengths)
    weights = max(lengths) * (4 * e2e_limits.layer_stack_params(CONFIG) + 1000 * 256) * 2
    value = (144 / 128) if fp8 else 2
    context = 10 * (5 + 7) + sum(n * (n - 1) / 2 for n in lengths)
    got = e2e_limits.rollout_limit_s(r, CONFIG, group=2, fp8=fp8) * e2e_limits.COPY_BANDWIDTH
    assert got == pytest.approx(context * 4 * PLANE_BF16 / 2 * value + weights)
    assert got < e2e_limits.rollout_limit_s(r, CONFIG, group=1, fp8=fp8) * e2e_limits.COPY_BANDWIDTH


@pytest.mark.parametrize(
    ("result", "expected"),
    [({}, (1, False)), ({"shared_prompts": True}, (2, False)), ({"shared_prompts": True, "kv_fp8": True}, (2, True))],
)
def test_the_table_reads_sharing_and_the_cache_dtype_from_the_result(monkeypatch, result, expected):
    seen = []
    real = e2e_limits.limits

    def spy(r, c, group=1, fp8=False):
        seen.append((group, fp8))
        return real(r, c, group, fp8)

    monkeypatch.setattr(e2e_limits, "limits", spy)
    r = {**record([4, 4, 4, 4]), "update": 0, "rollout_s": 1.0, "train_s": 1.0, "publish_s": 0.1}
    r.update(train_tokens=16, train_layer_tokens_required=64)
    e2e_limits.table({"shape": [2, 2, 4], "updates": [r, {**r, "update": 1}], **result}, CONFIG)
    assert seen and set(seen) == {expected}
