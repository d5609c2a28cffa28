"""Megatron dist checkpoints: bit-exact round trips, trainer-style checkpoints, run directories.

megatron-core costs ~4 s to import, so every test here shares one process and the
conversions that several tests inspect are done once per module.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ouro_cli.checkpoint import CheckpointError, layout, read_checkpoint, run_checkpoint_dir
from ouro_cli.checkpoint.convert import to_hf, to_megatron
from ouro_cli.checkpoint.hf import INDEX_FILE
from ouro_cli.checkpoint.megatron import MegatronCheckpoint, save_megatron, write_hf_assets
from ouro_cli.checkpoint.sources import open_checkpoint
from ouro_cli.errors import UserError
from ouro_cli.model import load

from .helpers import ASSET_FILES, assert_same_tensors, tiny_model, write_tiny_hf


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def round_trip(request, tmp_path_factory):
    """HF (sharded) -> Megatron -> HF for one dtype; returns the model and the three directories."""
    root = tmp_path_factory.mktemp(str(request.param).removeprefix("torch."))
    model = tiny_model(request.param)
    hf = write_tiny_hf(root / "hf", model, max_shard_bytes=30_000)
    mcore, back = root / "mcore", root / "back"
    to_megatron(open_checkpoint(hf), mcore, command="test", options={})
    to_hf(open_checkpoint(mcore), back, max_shard_bytes=30_000, command="test", options={})
    return model, hf, mcore, back


def test_input_is_sharded(round_trip):
    _, hf, _, _ = round_trip
    assert len(set(json.loads((hf / INDEX_FILE).read_text())["weight_map"].values())) > 2


def test_megatron_checkpoint_layout(round_trip):
    model, _, mcore, _ = round_trip
    assert (mcore / layout.TRACKER).read_text().strip() == "release"
    assert (mcore / "release" / "COMPLETE").is_file()
    assert (mcore / "COMPLETE").is_file() and (mcore / "manifest.json").is_file()
    assets = mcore / layout.HF_ASSETS
    assert sorted(p.name for p in assets.iterdir()) == sorted(["config.json", *ASSET_FILES])
    assert json.loads((assets / "config.json").read_text()) == model.config.to_dict()


def test_round_trip_is_bit_exact_with_dtype_preserved(round_trip):
    model, hf, mcore, back = round_trip
    state = model.state_dict()
    assert_same_tensors(read_checkpoint(mcore)[1], state)
    assert_same_tensors(read_checkpoint(back)[1], state)
    for name, text in ASSET_FILES.items():
        assert (back / name).read_text() == text
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert json.loads((back / INDEX_FILE).read_text()) == json.loads((hf / INDEX_FILE).read_text())


def test_load_gives_the_original_logits(round_trip):
    model, hf, mcore, _ = round_trip
    tokens = torch.tensor([[1, 5, 9, 33, 2, 0, 17]])
    with torch.no_grad():
        expected = model(tokens)
        for path in (hf, mcore):
            loaded = load(path)
            assert next(loaded.parameters()).dtype == model.lm_head.weight.dtype
            assert torch.equal(loaded(tokens), expected)


def test_small_load_batches_give_the_same_tensors(round_trip):
    model, _, mcore, _ = round_trip
    source = MegatronCheckpoint(mcore)
    assert_same_tensors(dict(source.iter_tensors(max_batch_bytes=1)), model.state_dict())


def test_trainer_checkpoint_in_a_run_dir(tmp_path):
    """Optimizer state, RNG objects and wrapper prefixes beside the model: only the model is read."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    from ouro_cli.mcore import megatron_on_cpu, single_process_group

    model = tiny_model()
    state = model.state_dict()
    ckpt = run_checkpoint_dir(tmp_path / "run")
    sharded = {
        "model": {n: ShardedTensor.from_rank_offsets(f"module.{n}", t.clone(), replica_id=0) for n, t in state.items()},
        "optimizer": {
            n: ShardedTensor.from_rank_offsets(f"optimizer.state.exp_avg.{n}", torch.randn(t.shape), replica_id=0)
            for n, t in state.items()
        },
        "rng": ShardedObject("rng_state", {"seed": 3}, (1,), (0,), replica_id=0),
        "iteration": 5,
    }
    staging = layout.staging_dir(ckpt, 5)
    with single_process_group(), megatron_on_cpu():
        dist_checkpointing.save(sharded, str(staging))
    write_hf_assets(ckpt, model.config, None)
    layout.commit_iteration(ckpt, 5)

    config, tensors = read_checkpoint(tmp_path / "run")
    assert config == model.config
    assert_same_tensors(tensors, state)
    assert open_checkpoint(tmp_path / "run").path == ckpt / "iter_0000005"


def test_incomplete_latest_iteration_is_refused(round_trip, tmp_path):
    _, _, mcore, _ = round_trip
    ckpt = tmp_path / "ckpt"
    shutil.copytree(mcore, ckpt)
    shutil.copytree(ckpt / "release", ckpt / "iter_0000007")
    (ckpt / "iter_0000007" / "COMPLETE").unlink()
    (ckpt / layout.TRACKER).write_text("7\n")
    with pytest.raises(UserError, match="incomplete"):
        read_checkpoint(ckpt)


def test_megatron_checkpoint_with_wrong_shapes_or_missing_tensors(tmp_path):
    model = tiny_model()
    state = dict(model.state_dict())
    del state["model.early_exit_gate.bias"]
    with pytest.raises(CheckpointError, match="missing tensors: model.early_exit_gate.bias"):
        save_megatron(tmp_path / "refused", model.config, state.items())

    save_megatron(tmp_path / "ckpt", model.config, model.state_dict().items())
    wider = model.config.to_dict() | {"intermediate_size": 128}
    (tmp_path / "ckpt" / layout.HF_ASSETS / "config.json").write_text(json.dumps(wider))
    with pytest.raises(
        CheckpointError, match=r"wrong shape: model.layers.0.mlp.gate_proj.weight \[96, 64\] \(expected \[128, 64\]\)"
    ):
        read_checkpoint(tmp_path / "ckpt")


def test_missing_hf_assets(round_trip, tmp_path):
    _, _, mcore, _ = round_trip
    shutil.copytree(mcore, tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / layout.HF_ASSETS)
    with pytest.raises(CheckpointError, match="no hf_assets/config.json"):
        read_checkpoint(tmp_path / "ckpt")


def test_output_overlapping_the_input_is_refused(round_trip):
    _, _, mcore, _ = round_trip
    source = open_checkpoint(mcore)
    for out in (mcore, mcore / "release" / "x", mcore.parent):
        with pytest.raises(UserError, match="overlaps the input"):
            to_hf(source, out, overwrite=True, command="test", options={})


def test_numbered_iteration(tmp_path):
    model = tiny_model()
    save_megatron(tmp_path / "ckpt", model.config, model.state_dict().items(), iteration=0)
    assert (tmp_path / "ckpt" / layout.TRACKER).read_text().strip() == "0"
    assert (tmp_path / "ckpt" / "iter_0000000" / "COMPLETE").is_file()
    assert_same_tensors(read_checkpoint(tmp_path / "ckpt")[1], model.state_dict())


def test_damaged_megatron_files_are_one_line_errors(round_trip, tmp_path):
    _, _, mcore, _ = round_trip
    shutil.copytree(mcore, tmp_path / "data")
    for data_file in (tmp_path / "data" / "release").glob("*.distcp"):
        data_file.write_bytes(data_file.read_bytes()[:100])
    source = open_checkpoint(tmp_path / "data")  # the metadata is intact
    with pytest.raises(CheckpointError, match="is damaged: reading") as err:
        dict(source.iter_tensors())
    assert "\n" not in str(err.value)

    shutil.copytree(mcore, tmp_path / "meta")
    (tmp_path / "meta" / "release" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="is not a readable Megatron dist checkpoint") as err:
        open_checkpoint(tmp_path / "meta")
    assert "\n" not in str(err.value)
