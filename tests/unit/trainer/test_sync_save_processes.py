"""A synchronous save starts no lasting helper process (mcore/sync_save.py): megatron's results
queue stays unset, so no Manager interpreter is spawned, for a trainer checkpoint and for
converted weights alike; what was written loads back unchanged."""

from __future__ import annotations

import copy
import multiprocessing

import pytest
import torch

from ouro_cli.checkpoint import read_checkpoint
from ouro_cli.model import build, tiny_config

pytest.importorskip("megatron.core")


@pytest.fixture
def spawned_nothing(monkeypatch):
    """megatron as in a process that has not saved yet (the attribute is restored afterwards);
    returns a check that nothing was started since."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    before = set(multiprocessing.active_children())

    def nothing() -> bool:
        return filesystem_async._results_queue is None and set(multiprocessing.active_children()) <= before

    return nothing


def test_a_trainer_save_spawns_no_results_manager(spawned_nothing, tmp_path):
    from _trainer_samples import make_samples

    from ouro_cli.trainer import Trainer, TrainerConfig

    model = build(tiny_config(), seed=3)
    with Trainer(copy.deepcopy(model), TrainerConfig(device="cpu", lr=1e-3)) as trainer:
        trainer.train_step(make_samples(model, 4, seed=1))
        trainer.save(tmp_path / "ckpt", 1, extra={"next_update": 1})
        assert spawned_nothing()
        saved = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
        trainer.train_step(make_samples(model, 4, seed=2))
        assert trainer.load(tmp_path / "ckpt") == {"next_update": 1}
        assert all(torch.equal(saved[n], p) for n, p in trainer.module.named_parameters())


def test_converted_weights_spawn_no_results_manager(spawned_nothing, tmp_path):
    from ouro_cli.checkpoint.megatron import save_megatron

    model = build(tiny_config(), seed=4)
    save_megatron(tmp_path / "mcore", model.config, model.state_dict().items())
    assert spawned_nothing()
    _, tensors = read_checkpoint(tmp_path / "mcore")
    assert tensors.keys() == model.state_dict().keys()
    assert all(torch.equal(tensors[n], t) for n, t in model.state_dict().items())
