"""What a process imports, read from `sys.modules` in a fresh interpreter: the CLI's own import
and what `ouro status` reads stay off torch, a command that reads weights stays off
megatron-core (and TorchDynamo), and megatron-core's own import compiles nothing
(mcore/importing.py) until a compiled function is called, which then goes to the real
`torch.compile` with its arguments, and leaves the wandb client unloaded (it still imports
afterwards). The packages that resolve their names lazily resolve
every name they export."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import sys

def loaded(*names):
    return [n for n in names if n in sys.modules]

import ouro_cli.cli.app
import ouro_cli.checkpoint.layout
import ouro_cli.model.config
import ouro_cli.rl.status
from ouro_cli.checkpoint.sources import assets_dir
from ouro_cli.defaults import recipe_for
recipe_for(sys.argv[1])  # reads the config.json that `auto` options follow
assert not loaded("torch", "megatron", "matplotlib"), loaded("torch", "megatron", "matplotlib")

from ouro_cli.checkpoint import read_checkpoint
from ouro_cli.model import from_state_dict
config, tensors = read_checkpoint(sys.argv[1])
from_state_dict(config, tensors)
assert len(tensors) > 0 and not loaded("megatron", "torch._dynamo"), loaded("megatron", "torch._dynamo")

from ouro_cli.mcore.importing import import_megatron_core
import_megatron_core()
import torch
from megatron.core import jit
assert "megatron.core" in sys.modules and jit.jit_fuser is not torch.compile
assert not loaded("torch._inductor.compile_fx"), "megatron's import set up Inductor"
assert not loaded("wandb"), "megatron's import loaded the wandb client"
import importlib.util
if importlib.util.find_spec("wandb") is not None:  # hidden only while megatron-core loaded
    import wandb
    assert "wandb" in sys.modules and wandb.__name__ == "wandb"
print("ok")
"""


@pytest.fixture(scope="module")
def megatron_checkpoint(tmp_path_factory):
    pytest.importorskip("megatron.core")
    from ouro_cli.checkpoint.megatron import save_megatron
    from ouro_cli.model import build, tiny_config

    model = build(tiny_config(), seed=5)
    root = tmp_path_factory.mktemp("mcore") / "ckpt"
    save_megatron(root, model.config, model.state_dict().items())
    return root


def test_commands_import_only_what_they_use(megatron_checkpoint):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(megatron_checkpoint)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_deferred_compile_compiles_at_the_first_call_with_the_same_arguments():
    from ouro_cli.mcore.importing import _deferring

    calls = []

    def real(model, **options):
        calls.append((model, options))
        return lambda x: model(x) + 1

    deferred = _deferring(real)

    def double(x):
        return 2 * x

    fused = deferred(double)
    decorated = deferred(fullgraph=True)(double)
    assert calls == [] and fused.__name__ == "double"
    assert fused(3) == 7 and fused(4) == 9
    assert decorated(1) == 3
    assert calls == [(double, {}), (double, {"fullgraph": True})]  # once each, as given
    module = torch.nn.Linear(2, 2)
    assert deferred(module, dynamic=False)(torch.ones(2)) is not None and calls[-1] == (module, {"dynamic": False})


@pytest.mark.parametrize("package", ["ouro_cli.model", "ouro_cli.checkpoint"])
def test_a_lazy_package_resolves_every_name_it_exports(package):
    import importlib

    module = importlib.import_module(package)
    assert module.__all__ and all(getattr(module, name) is not None for name in module.__all__)
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018
