"""An `ouro export` loads in transformers after `import ouro_cli.hf` and generates the engine's tokens.

Two exports: `ouro export` of the bundled tiny model as a real subprocess (what `make demo`
trains; it carries no remote code, so its export must not name any), and one of a checkpoint
that carries the remote-code files, as the public ones do (they travel, and stay named in
`auto_map`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ouro_cli.bundled import TINY
from ouro_cli.checkpoint import convert, open_checkpoint, write_hf
from ouro_cli.model import build, tiny_config

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = TINY / "model"
REMOTE_CODE = {
    "modeling_ouro.py": "raise ImportError('the remote code stand-in must not be imported')\n",
    "configuration_ouro.py": "raise ImportError('the remote code stand-in must not be imported')\n",
}
T = 4
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{"bundled": `ouro export` of the bundled model, "remote": the same export back end
    (`convert.to_hf`, in process) of a checkpoint with remote code}."""
    root = tmp_path_factory.mktemp("hf-export")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "ouro_cli.cli.app", "export", str(TINY_MODEL), str(root / "bundled"), "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    source, assets = root / "remote-src", root / "assets"
    source.mkdir()
    assets.mkdir()
    for name, text in REMOTE_CODE.items():
        (assets / name).write_text(text)
    model = build(tiny_config(), seed=1)
    write_hf(source, model.config, model.state_dict().items(), assets_from=assets)
    convert.to_hf(open_checkpoint(source), root / "remote", command="export", options={})
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert json.loads(stdout)["ok"] is True
    return {"bundled": root / "bundled", "remote": root / "remote"}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_the_export_names_only_the_remote_code_it_carries(exports):
    bundled, remote = exports["bundled"], exports["remote"]
    assert not list(bundled.glob("*.py"))
    source = _config(TINY_MODEL)
    assert "auto_map" in source and "auto_map" not in _config(bundled)
    assert {k: v for k, v in source.items() if k != "auto_map"} == _config(bundled)
    for name, text in REMOTE_CODE.items():
        assert (remote / name).read_text() == text
    assert _config(remote)["auto_map"] == tiny_config().extra["auto_map"]


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@torch.no_grad()
def test_greedy_generate_is_the_engines_greedy_decoding(exports):
    """Prompts of the bundled task, batched with padding on the left: greedy `generate` emits
    the engine's greedy tokens at full depth (K = T, by default and with use_cache=False) and
    at K = 2 (`max_loops`), token for token. EOS does not stop either side."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ouro_cli.hf
    from ouro_cli.engine import LLM, SamplingParams

    export = exports["bundled"]
    model = AutoModelForCausalLM.from_pretrained(export)
    assert type(model) is ouro_cli.hf.OuroForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(export)
    first = json.loads((TINY / "eval.jsonl").read_text().splitlines()[0])["prompt"]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in (first, "What is 3?", "What is 1+2*3-4?")
    ]
    prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    assert len({len(p) for p in prompts}) > 1  # the batch pads
    llm = LLM(export, max_num_seqs=4, kv_blocks=64, block_size=8, cuda_graphs=False)
    ids, mask = _left_padded(prompts)
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    for k, options in [(T, {}), (T, {"use_cache": False}), (2, {"max_loops": 2})]:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, max_loops=k, ignore_eos=True)
        engine = [out.output_token_ids for out in llm.generate(prompts, params)]
        generated = model.generate(ids, attention_mask=mask, **greedy, **options)[:, ids.shape[1] :]
        assert generated.tolist() == engine, (k, options)


@torch.no_grad()
def test_an_export_with_remote_code_loads_ours_and_samples(exports):
    """Without trust_remote_code the registered classes win over `auto_map` (the stand-in
    remote code raises if imported); sampling runs and is seeded."""
    from transformers import AutoModelForCausalLM, set_seed

    import ouro_cli.hf
    from ouro_cli.model import load

    export = exports["remote"]
    model = AutoModelForCausalLM.from_pretrained(export)
    assert type(model) is ouro_cli.hf.OuroForCausalLM
    ids = torch.tensor([[1, 5, 6, 7]])
    assert torch.equal(model(ids).logits, load(export)(ids))
    samples = []
    for _ in range(2):
        set_seed(0)
        samples.append(model.generate(ids, max_new_tokens=8, do_sample=True, temperature=1.0, eos_token_id=None))
    assert samples[0].shape == (1, 12) and torch.equal(samples[0], samples[1])
    assert int(samples[0].max()) < model.config.vocab_size
