"""Ouro in transformers, from our own model code: `import ouro_cli.hf` and the Auto classes load it.

    import ouro_cli.hf  # registers model_type "ouro" with AutoConfig and AutoModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained("export/ouro-1.4b-grpo")
    tokenizer = AutoTokenizer.from_pretrained("export/ouro-1.4b-grpo")
    ids = tokenizer("1+1=", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=32, do_sample=False)  # full depth T per token
    out = model.generate(ids, max_new_tokens=32, max_loops=2)      # decoded tokens at K = 2

No remote code runs: the classes are `configuration.OuroConfig` and `modeling.OuroForCausalLM`,
which wrap `ouro_cli.model`. Without `trust_remote_code`, transformers takes a registered
class over a checkpoint's `auto_map`, so a directory that also carries the public remote code
(`modeling_ouro.py`) loads with ours; `trust_remote_code=True` picks the remote code instead.
How deep each token runs and how the per-loop KV cache is kept: `modeling`'s docstring.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration import OuroConfig
from .modeling import OuroForCausalLM

AutoConfig.register(OuroConfig.model_type, OuroConfig, exist_ok=True)
AutoModelForCausalLM.register(OuroConfig, OuroForCausalLM, exist_ok=True)

__all__ = ["OuroConfig", "OuroForCausalLM"]
