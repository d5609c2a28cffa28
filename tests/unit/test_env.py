"""ouro_cli/env.py declares every variable the package reads or sets, and reads each alike:
parsed where set, its default where unset or empty; an undeclared name is an error."""

from __future__ import annotations

import pytest

from ouro_cli import env
from ouro_cli.config import leaves
from ouro_cli.rl.options import EvalOptions, TrainOptions


def test_every_variable_an_option_names_is_declared():
    named = {leaf.info.env for root in (TrainOptions, EvalOptions) for leaf in leaves(root).values() if leaf.info.env}
    assert len(named) >= 7 and named <= set(env.VARIABLES)
    assert {n for n, v in env.VARIABLES.items() if v.test_only} == {
        n for n in env.VARIABLES if n.startswith("OURO_TEST_")
    }


def test_a_variable_reads_as_declared(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OURO_DEBUG", "OURO_TEST_KV_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    assert (env.rank(), env.local_rank(), env.world_size(), env.debug()) == (0, 0, 1, False)
    assert env.get("OURO_TEST_KV_LIMIT") is None and not env.launched_by_torchrun()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "")
    monkeypatch.setenv("OURO_DEBUG", "0")
    assert (env.rank(), env.world_size(), env.debug(), env.launched_by_torchrun()) == (3, 1, False, True)
    monkeypatch.setenv("OURO_DEBUG", "1")
    monkeypatch.setenv("OURO_TEST_KV_LIMIT", "12")
    assert env.debug() and env.get("OURO_TEST_KV_LIMIT") == 12


def test_writes_reach_the_environment(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    env.set_default("UCX_TLS", "rc")
    assert env.get("UCX_TLS") == "tcp"
    env.put("UCX_TLS", None)
    assert not env.is_set("UCX_TLS")
    env.put("UCX_TLS", "rc")
    assert env.get("UCX_TLS") == "rc"


def test_an_undeclared_variable_is_an_error():
    for call in (env.get, env.is_set, lambda n: env.put(n, "1"), lambda n: env.set_default(n, "1")):
        with pytest.raises(KeyError, match="not declared in ouro_cli/env.py"):
            call("OURO_NOT_A_VARIABLE")


def test_an_option_reads_its_variable_in_the_options_own_values(monkeypatch):
    """OURO_COMPILE takes --compile's values; the switch's 1 and 0 are not among them."""
    from ouro_cli.errors import SettingError
    from ouro_cli.settings import ExecutionSettings, from_environment

    monkeypatch.setenv("OURO_COMPILE", "off")
    monkeypatch.setenv("OURO_COMPILE_LAYERS", "")
    assert from_environment(ExecutionSettings) == {"compile": "off"}
    for old in ("1", "0"):
        monkeypatch.setenv("OURO_COMPILE", old)
        with pytest.raises(SettingError, match=f"^OURO_COMPILE='{old}': must be one of auto, off, always"):
            from_environment(ExecutionSettings)
