"""Hugging Face directories: streaming sharded writes, lazy validated reads, assets, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ouro_cli.checkpoint import (
    CheckpointError,
    HFCheckpoint,
    TensorSpec,
    parse_size,
    read_checkpoint,
    write_hf,
)
from ouro_cli.checkpoint.hf import INDEX_FILE, SINGLE_FILE
from ouro_cli.model import ConfigError, tiny_config

from .helpers import ASSET_FILES, assert_same_tensors, tiny_model, write_tiny_hf


def test_single_file_when_it_fits(tmp_path):
    model = tiny_model()
    write_tiny_hf(tmp_path / "hf", model)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == sorted([SINGLE_FILE, "config.json", *ASSET_FILES])
    with safe_open(tmp_path / "hf" / SINGLE_FILE, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    config, tensors = read_checkpoint(tmp_path / "hf")
    assert config == model.config
    assert_same_tensors(tensors, model.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_write_has_a_consistent_index(tmp_path, dtype):
    model = tiny_model(dtype)
    state = model.state_dict()
    limit = 40_000 if dtype == torch.float32 else 20_000
    write_tiny_hf(tmp_path / "hf", model, max_shard_bytes=limit)
    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 2
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert sorted(index["weight_map"]) == sorted(state)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    assert not (tmp_path / "hf" / SINGLE_FILE).exists()
    for shard in shards:
        with safe_open(tmp_path / "hf" / shard, framework="pt") as f:
            keys = list(f.keys())
            assert all(index["weight_map"][k] == shard for k in keys)
            big = [k for k in keys if state[k].nbytes > limit]
            assert len(keys) == 1 or (not big and sum(state[k].nbytes for k in keys) <= limit)
    _, tensors = read_checkpoint(tmp_path / "hf")
    assert_same_tensors(tensors, state)


def test_planned_writing_accepts_any_order_and_matches_gathered_writing(tmp_path):
    model = tiny_model()
    state = model.state_dict()
    specs = {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in state.items()}
    shuffled = [list(state.items())[i] for i in torch.randperm(len(state), generator=torch.Generator().manual_seed(1))]
    for name, kwargs, items in [("gathered", {}, state.items()), ("planned", {"specs": specs}, shuffled)]:
        (tmp_path / name).mkdir()
        write_hf(tmp_path / name, model.config, items, max_shard_bytes=40_000, **kwargs)
        assert_same_tensors(read_checkpoint(tmp_path / name)[1], state)
    index = [json.loads((tmp_path / name / INDEX_FILE).read_text()) for name in ("gathered", "planned")]
    assert index[0] == index[1]
    for shard in set(index[0]["weight_map"].values()):
        assert (tmp_path / "gathered" / shard).read_bytes() == (tmp_path / "planned" / shard).read_bytes()


def test_mixed_dtypes_stay_aligned_and_load_with_safetensors(tmp_path):
    from safetensors.torch import load_file

    model = tiny_model()
    state = {n: (t.to(torch.bfloat16) if "norm" in n else t) for n, t in model.state_dict().items()}
    (tmp_path / "hf").mkdir()
    write_hf(tmp_path / "hf", model.config, state.items())
    loaded = load_file(tmp_path / "hf" / SINGLE_FILE)
    assert_same_tensors(loaded, state)
    with open(tmp_path / "hf" / SINGLE_FILE, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    assert header_len % 8 == 0
    for name, entry in header.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % state[name].dtype.itemsize == 0, name


def test_planned_writing_refuses_an_unplanned_or_misshaped_tensor(tmp_path):
    model = tiny_model()
    specs = {"lm_head.weight": TensorSpec((128, 64), torch.float32)}
    with pytest.raises(ValueError, match="was not planned"):
        write_hf(tmp_path, model.config, [("model.norm.weight", torch.ones(64))], specs=specs)
    with pytest.raises(ValueError, match="planned"):
        write_hf(tmp_path, model.config, [("lm_head.weight", torch.ones(128, 64, dtype=torch.bfloat16))], specs=specs)


def test_config_keeps_unknown_keys(tmp_path):
    model = tiny_model()
    write_tiny_hf(tmp_path / "hf", model)
    data = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert data["auto_map"]["AutoModelForCausalLM"] == "modeling_ouro.OuroForCausalLM"
    assert data["model_type"] == "ouro"


def test_views_into_one_flat_buffer_are_written(tmp_path):
    """A trainer may hand out views into a flat parameter buffer; safetensors refuses shared storage."""
    config = tiny_config()
    state = tiny_model().state_dict()
    flat = torch.cat([t.flatten() for t in state.values()])
    views, offset = {}, 0
    for name, t in state.items():
        views[name] = flat[offset : offset + t.numel()].view(t.shape)
        offset += t.numel()
    (tmp_path / "hf").mkdir()
    write_hf(tmp_path / "hf", config, views.items())
    assert_same_tensors(read_checkpoint(tmp_path / "hf")[1], state)


def test_wrapper_prefixes_in_stored_names_are_accepted(tmp_path):
    model = tiny_model()
    state = model.state_dict()
    (tmp_path / "hf").mkdir()
    write_hf(tmp_path / "hf", model.config, ((f"module.{n}", t) for n, t in state.items()))
    assert_same_tensors(read_checkpoint(tmp_path / "hf")[1], state)


def _corrupt(tmp_path, edit):
    model = tiny_model()
    state = dict(model.state_dict())
    config = edit(state) or model.config
    (tmp_path / "bad").mkdir()
    write_hf(tmp_path / "bad", config, state.items())
    return tmp_path / "bad"


def test_missing_extra_and_misshaped_tensors_are_reported_together(tmp_path):
    def edit(state):
        del state["model.norm.weight"]
        state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
        state["lm_head.weight"] = torch.zeros(3, 64)

    with pytest.raises(CheckpointError) as err:
        HFCheckpoint(_corrupt(tmp_path, edit))
    message = str(err.value)
    assert "missing tensors: model.norm.weight" in message
    assert "unexpected tensors: model.layers.9.mlp.up_proj.weight" in message
    assert "lm_head.weight [3, 64] (expected [128, 64])" in message


def test_truncated_safetensors_is_one_clear_error(tmp_path):
    path = write_tiny_hf(tmp_path / "hf", tiny_model(), max_shard_bytes=40_000)
    shard = path / _shards(path)[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name} is not a readable safetensors file.*truncated"):
        HFCheckpoint(path)


def _shards(path):
    return sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))


def test_index_naming_an_absent_shard(tmp_path):
    path = write_tiny_hf(tmp_path / "hf", tiny_model(), max_shard_bytes=40_000)
    shard = _shards(path)[2]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"do not exist: {shard}"):
        HFCheckpoint(path)


def test_index_disagreeing_with_the_shards(tmp_path):
    path = write_tiny_hf(tmp_path / "hf", tiny_model(), max_shard_bytes=40_000)
    index = json.loads((path / INDEX_FILE).read_text())
    first, second = _shards(path)[:2]
    index["weight_map"]["lm_head.weight"] = second if index["weight_map"]["lm_head.weight"] == first else first
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lists lm_head.weight in model-000.*, but "):
        HFCheckpoint(path)


def test_wrong_model_type_is_a_config_error(tmp_path):
    path = write_tiny_hf(tmp_path / "hf", tiny_model())
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type is 'llama'"):
        HFCheckpoint(path)


def test_no_weights(tmp_path):
    tiny_config().save(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no model.safetensors .*found pytorch_model.bin"):
        read_checkpoint(tmp_path)


def test_not_a_checkpoint(tmp_path):
    from ouro_cli.errors import UserError

    with pytest.raises(UserError, match="is not an Ouro checkpoint"):
        read_checkpoint(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        read_checkpoint(tmp_path / "nope")


def test_a_run_without_a_checkpoint_and_a_link_loop_say_so(tmp_path):
    """A run stopped before its first save is a run, not "not an Ouro checkpoint"; a symbolic
    link loop is named as one, by every reader and by the output guard."""
    from ouro_cli.errors import UserError
    from ouro_cli.outputs import check_outside_inputs
    from ouro_cli.rl.run_dir import RunDir

    run = RunDir(tmp_path / "run")
    (run.checkpoint / "hf_assets").mkdir(parents=True)
    run.plan.write_text("{}")
    with pytest.raises(UserError) as err:
        read_checkpoint(run.root)
    assert str(err.value) == (
        f"{run.root} is a run that has not saved a checkpoint yet; read it after its first "
        "save (--save-interval), or continue it with `ouro resume`"
    )
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    loop = f"{tmp_path / 'a'} is a symbolic link loop; point it at a real file or directory"
    for read in (
        lambda: read_checkpoint(tmp_path / "a"),
        lambda: check_outside_inputs(tmp_path / "out", [tmp_path / "a"]),
    ):
        with pytest.raises(UserError) as err:
            read()
        assert str(err.value) == loop


@pytest.mark.parametrize(
    "text, size",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1000", 1000),
        ("1.5kb", 1500),
        ("10 MiB", 10 * 2**20),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "-5GB", "5XB", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)
