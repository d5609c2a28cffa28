"""An HF export of a checkpoint says what its policy was trained with where that changed the
function it is (checkpoint/trained_with.py): a run's iteration whose plan records an fp8 KV
cache gets README.md and `trained_with` in the manifest and the summary; an iteration whose
plan records the model's dtype, and a checkpoint without a plan, get neither."""

from __future__ import annotations

import json

import pytest

from ouro_cli.checkpoint import convert, open_checkpoint, write_hf
from ouro_cli.checkpoint.trained_with import README, trained_with
from ouro_cli.model import build, tiny_config


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "model", None])
def test_an_export_notes_an_fp8_kv_cache(tmp_path, kv_cache_dtype):
    source = tmp_path / "source"  # stands in for a run's iteration: the plan beside the weights
    source.mkdir()
    model = build(tiny_config(), seed=1)
    write_hf(source, model.config, model.state_dict().items())
    if kv_cache_dtype is not None:
        plan = {"contract": {"execution": {"exact": "off", "kv_cache_dtype": kv_cache_dtype}}}
        (source / "ouro-plan.json").write_text(json.dumps(plan))
    fp8 = kv_cache_dtype == "fp8"
    assert trained_with(source) == ({"kv_cache_dtype": "fp8"} if fp8 else {})
    summary = convert.to_hf(open_checkpoint(source), tmp_path / "out", command="export", options={"x": 1})
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (tmp_path / "out" / README).is_file() == fp8
    assert (
        manifest["options"].get("trained_with")
        == summary.get("trained_with")
        == ({"kv_cache_dtype": "fp8"} if fp8 else None)
    )
    if fp8:
        assert "--kv-cache-dtype fp8" in (tmp_path / "out" / README).read_text()
