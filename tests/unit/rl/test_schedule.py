"""Depth schedule, execution-config hash and the GRPO group check."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl.schedule import (
    EXECUTION_KEYS,
    GroupMismatch,
    config_hash,
    depth_for_update,
    execution_settings,
    validate_depths,
    validate_group,
    validate_min_loops,
)


def test_schedule_cycles():
    depths = validate_depths([2, 3, 4], total_loops=4)
    assert [depth_for_update(depths, u) for u in range(7)] == [2, 3, 4, 2, 3, 4, 2]
    assert [depth_for_update([4], u) for u in range(3)] == [4, 4, 4]


@pytest.mark.parametrize(
    "depths,message",
    [
        ([], "at least one"),
        ([0], r"K=0 is outside 1\.\.4"),
        ([2, 5], r"K=5 is outside 1\.\.4 .*total_ut_steps=4"),
        ([2.5], "not an integer"),
        ([True], "not an integer"),
    ],
)
def test_bad_depths(depths, message):
    with pytest.raises(UserError, match=message):
        validate_depths(depths, total_loops=4)


def test_a_depth_error_names_the_flag_it_came_from():
    with pytest.raises(UserError, match=r"^--eval-depths: K=7 is outside 1\.\.4"):
        validate_depths([2, 7], total_loops=4, flag="--eval-depths")


def test_min_loops_cannot_exceed_the_models_loops():
    assert validate_min_loops(4, total_loops=4) == 4
    with pytest.raises(UserError, match=r"^--min-loops 9 is more than the model's total_ut_steps=4 loops"):
        validate_min_loops(9, total_loops=4)


def test_negative_update():
    with pytest.raises(ValueError):
        depth_for_update([2], -1)


@dataclass(frozen=True)
class Params:  # the attributes of a resolved engine SamplingParams that matter here
    max_loops: int | None = 3
    min_loops: int = 1
    exit_threshold: float = 1.0
    exit_mode: str = "immediate"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logprobs_mode: str = "processed"


def settings(**changes):
    return execution_settings(replace(Params(), **changes), prefill_depth=4)


def test_hash_is_sha256_of_canonical_json():
    s = settings()
    assert set(s) == set(EXECUTION_KEYS)
    expected = hashlib.sha256(
        json.dumps(
            {
                "async_scheduling": False,
                "exit_mode": "immediate",
                "exit_threshold": 1,
                "logprobs_mode": "processed",
                "max_loops": 3,
                "min_loops": 1,
                "prefill_depth": 4,
                "speculative_tokens": 0,
                "temperature": 1,
                "top_k": -1,
                "top_p": 1,
            },
            separators=(",", ":"),
            sort_keys=True,
        ).encode()
    ).hexdigest()
    assert config_hash(s) == expected
    assert config_hash(dict(reversed(list(s.items())))) == expected  # key order does not matter
    assert config_hash({**s, "temperature": 1}) == config_hash({**s, "temperature": 1.0})


@pytest.mark.parametrize(
    "change",
    [
        dict(max_loops=2),
        dict(min_loops=2),
        dict(exit_threshold=0.9),
        dict(exit_mode="delayed"),
        dict(temperature=0.7),
        dict(top_p=0.95),
        dict(top_k=50),
        dict(logprobs_mode="raw"),
    ],
)
def test_every_setting_changes_the_hash(change):
    assert config_hash(settings(**change)) != config_hash(settings())


def test_engine_level_settings_change_the_hash():
    base = config_hash(settings())
    assert config_hash(execution_settings(Params(), prefill_depth=3)) != base
    assert config_hash(execution_settings(Params(), prefill_depth=4, async_scheduling=True)) != base
    assert config_hash(execution_settings(Params(), prefill_depth=4, speculative_tokens=2)) != base


def test_hash_refuses_incomplete_or_odd_settings():
    s = settings()
    del s["top_k"]
    with pytest.raises(ValueError, match="lack top_k"):
        config_hash(s)
    with pytest.raises(ValueError, match="canonical"):
        config_hash({**settings(), "temperature": float("nan")})
    with pytest.raises(ValueError, match="resolved"):
        execution_settings(Params(max_loops=None), prefill_depth=4)


def sample(**changes):
    return {"prompt_id": "p1", "k": 3, "weight_version": 2, "config_hash": "abc", **changes}


def test_group_ok():
    validate_group([sample() for _ in range(4)])


@pytest.mark.parametrize(
    "field,what",
    [("prompt_id", "prompt ids"), ("k", "Ks"), ("weight_version", "policy versions"), ("config_hash", "config hashs")],
)
def test_group_mismatch_names_the_field(field, what):
    group = [sample(), sample(), sample(**{field: "other"}), sample()]
    with pytest.raises(
        GroupMismatch, match=rf"mixes {what}: sample 0 has .*, sample 2 has 'other' \(2 distinct values in 4 samples\)"
    ):
        validate_group(group)


def test_group_of_engine_like_objects():
    @dataclass
    class Output:  # RequestOutput keeps K in its sampling params
        weight_version: int
        sampling_params: Params
        prompt_id: str = "p"
        config_hash: str = "h"

    validate_group([Output(1, Params(max_loops=2)), Output(1, Params(max_loops=2))])
    with pytest.raises(GroupMismatch, match="mixes Ks"):
        validate_group([Output(1, Params(max_loops=2)), Output(1, Params(max_loops=3))])
    with pytest.raises(GroupMismatch, match="no config_hash"):
        validate_group([{"prompt_id": 1, "k": 2, "weight_version": 1}])
    with pytest.raises(GroupMismatch, match="empty"):
        validate_group([])
