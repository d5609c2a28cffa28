"""`--kv-cache-dtype` is part of a run's contract (`execution.kv_cache_dtype`): fp8 is recorded as
such, auto and bf16 (both the model's dtype, unquantized) alike; a resume that would change it is
refused naming the flag, and so is a plan that does not record it; bf16 with a model computing
in fp32 is refused before anything runs. `--share-prompts` is in the contract too (it decides
how many sequences the cache holds at once); a plan older than it reads as sharing."""

from __future__ import annotations

import pytest

from ouro_cli.config import build
from ouro_cli.errors import SettingError, UserError
from ouro_cli.rl import plan as plans
from ouro_cli.rl.options import TrainOptions


def contract(**options):
    return plans.build_contract(
        build(TrainOptions, {"device": "cpu", **options}).validate(),
        data_sha256="d" * 64,
        model_config={"x": 1},
        tokenizer_sha256=None,
        template={"name": "chatml"},
        num_loops=4,
    )


def test_the_kv_cache_dtype_is_recorded_and_a_change_is_refused_naming_it():
    plain, fp8 = contract(), contract(kv_cache_dtype="fp8")
    assert plain["execution"]["kv_cache_dtype"] == "model" and fp8["execution"]["kv_cache_dtype"] == "fp8"
    assert {k: v for k, v in fp8["execution"].items() if k != "kv_cache_dtype"} == {
        k: v for k, v in plain["execution"].items() if k != "kv_cache_dtype"
    }
    plans.check_same_contract(fp8, contract(kv_cache_dtype="fp8"), allow_scheduler=False)
    bf16 = contract(dtype="bf16")
    plans.check_same_contract(bf16, contract(dtype="bf16", kv_cache_dtype="bf16"), allow_scheduler=False)
    with pytest.raises(
        UserError,
        match=r"^resume would change execution.kv_cache_dtype: the run has 'fp8', this invocation "
        r"'model' \(set by --kv-cache-dtype; resume with the run's\)",
    ):
        plans.check_same_contract(fp8, plain, allow_scheduler=False)


def test_a_plan_written_before_the_key_resumes_unquantized_only():
    """A plan without `kv_cache_dtype` was written when every cache held the model's dtype: it
    resumes as such, and a resume that asks for fp8 is refused naming the key."""
    old = contract()
    old["execution"] = {k: v for k, v in old["execution"].items() if k != "kv_cache_dtype"}
    plans.check_same_contract(old, contract(), allow_scheduler=False)
    with pytest.raises(UserError, match="^resume would change execution.kv_cache_dtype: the run has 'model'"):
        plans.check_same_contract(old, contract(kv_cache_dtype="fp8"), allow_scheduler=False)


def test_a_plan_written_before_share_prompts_resumes_sharing():
    """A contract without `share_prompts` was written when the engine always shared a group's
    prompt: it resumes so, and a resume with --no-share-prompts is refused naming the key."""
    old = contract()
    assert old.pop("share_prompts") is True
    plans.check_same_contract(old, contract(), allow_scheduler=False)
    with pytest.raises(UserError, match="^resume would change share_prompts: the run has True, this invocation False"):
        plans.check_same_contract(old, contract(share_prompts=False), allow_scheduler=False)


def test_bf16_needs_a_model_in_bf16():
    with pytest.raises(SettingError, match=r"^--kv-cache-dtype bf16 keeps K/V in the model's dtype, .* fp32"):
        contract(kv_cache_dtype="bf16")  # a CPU run computes in fp32 by default
