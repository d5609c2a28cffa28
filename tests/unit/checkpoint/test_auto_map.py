"""An HF directory we write names in `auto_map` only the remote code it holds."""

from __future__ import annotations

import json

from ouro_cli.checkpoint import write_hf
from ouro_cli.checkpoint.assets import naming_present_code
from ouro_cli.model import tiny_config

from .helpers import ASSET_FILES, tiny_model

AUTO_MAP = tiny_config().extra["auto_map"]


def _written(tmp_path, files: dict[str, str]) -> tuple[dict, list[str]]:
    """config.json and the file names of a directory written from assets holding `files`."""
    assets, out = tmp_path / "assets", tmp_path / "out"
    assets.mkdir()
    out.mkdir()
    for name, text in files.items():
        (assets / name).write_text(text)
    model = tiny_model()
    write_hf(out, model.config, model.state_dict().items(), assets_from=assets)
    return json.loads((out / "config.json").read_text()), sorted(p.name for p in out.iterdir())


def test_remote_code_travels_and_stays_named(tmp_path):
    config, names = _written(tmp_path, ASSET_FILES)
    assert {"modeling_ouro.py", "configuration_ouro.py"} <= set(names)
    assert config["auto_map"] == AUTO_MAP


def test_without_remote_code_auto_map_is_dropped_and_the_rest_kept(tmp_path):
    tokenizer_only = {k: v for k, v in ASSET_FILES.items() if not k.endswith(".py")}
    config, names = _written(tmp_path, tokenizer_only)
    assert not any(n.endswith(".py") for n in names)
    assert "auto_map" not in config
    assert config["architectures"] == ["OuroForCausalLM"] and config["torch_dtype"] == "float32"


def test_an_entry_stays_only_where_all_its_code_is_present(tmp_path):
    (tmp_path / "modeling_ouro.py").write_text("")
    (tmp_path / "tokenization_ouro.py").write_text("")
    config = tiny_config()
    config.extra["auto_map"] = {
        **AUTO_MAP,  # configuration_ouro.py is absent
        "AutoTokenizer": ["tokenization_ouro.OuroTokenizer", None],
        "AutoModel": "other/repo--modeling_ouro.OuroModel",  # another repository's code
        "AutoModelForSequenceClassification": ["tokenization_ouro.X", "absent.Y"],
    }
    kept = naming_present_code(config, tmp_path).extra["auto_map"]
    assert kept == {
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
        "AutoTokenizer": ["tokenization_ouro.OuroTokenizer", None],
        "AutoModel": "other/repo--modeling_ouro.OuroModel",
    }
    assert config.extra["auto_map"]["AutoConfig"] == "configuration_ouro.OuroConfig"  # the input is not changed
