"""`OuroForCausalLM` for transformers: our model behind `PreTrainedModel` and `GenerationMixin`.

The module tree is our model's (`model.layers.{i}...`, `model.norm`, `model.early_exit_gate`,
`lm_head`: docs/model.md §1), so `from_pretrained` reads an Ouro directory's safetensors
under their physical names with no mapping. The computation is our model's too: the wrapper
holds an `ouro_cli.model.OuroForCausalLM` around the same modules and calls its public
entry points, its `forward` for a sequence without cached keys and `run_loop` for tokens
appended to a cache, so transformers runs the forward pass the engine and the trainer run
(eager: nothing compiles here).

Depth (docs/model.md §3). Every token of a call without cached keys (the prompt, or the
whole sequence with `use_cache=False`) runs all T loops. A token appended to the cache runs
`max_loops` loops (K; None: T), a keyword of `forward` that `generate` passes through:
`model.generate(ids, max_loops=2)` decodes at K = 2 after a full-depth prefill, as the
engine's `SamplingParams(max_loops=2)` does with no early exit. A shallower token leaves its
last-exited K/V in the deeper planes (copies of its plane K). Without the cache there is no
telling the prompt from the tokens generated after it, so K < T needs `use_cache=True` (the
default).

The cache. Each loop t has its own KV plane per layer (T × L planes). A transformers cache
holds one key and one value tensor per layer, [B, heads, S, D]; layer i's holds its T planes
stacked along the heads, [B, T·Hkv, S, D], plane t at heads (t-1)·Hkv .. t·Hkv - 1. So the
default `DynamicCache` that `generate` makes serves as it is, and its length, batch
reordering (beam search) and cropping act on every plane alike.
"""

from __future__ import annotations

from dataclasses import fields

import torch
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

import ouro_cli.model
from ouro_cli.model.attention import dense_attention
from ouro_cli.settings import ExecutionSettings

from .configuration import OuroConfig

EAGER = ExecutionSettings(compile="off")

# transformers names the cache `cache` in a model's inputs and outputs from 5.24 on, `past_key_values` before
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"

Planes = list[tuple[torch.Tensor, torch.Tensor]]  # per loop t = 1..T: (k, v) [B, S, Hkv, D]


class OuroForCausalLM(PreTrainedModel, GenerationMixin):
    """Ouro as a transformers causal LM (module docstring): full depth T per token, or
    `max_loops` for the tokens appended to a cache."""

    config_class = OuroConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config: OuroConfig) -> None:
        super().__init__(config)
        ours = ouro_cli.model.OuroForCausalLM(config.to_ouro(), execution=EAGER)
        self.model, self.lm_head = ours.model, ours.lm_head
        # not a submodule: its modules are this model's own (above), registered once
        object.__setattr__(self, "_core", ours)
        self.post_init()

    def core(self) -> ouro_cli.model.OuroForCausalLM:
        """Our model over this model's current modules (transformers may swap the embeddings or the head)."""
        self._core.model, self._core.lm_head = self.model, self.lm_head
        return self._core

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        max_loops: int | None = None,
        token_type_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """input_ids [B, n], the tokens after the cache's P -> logits [B, n, V] (the last
        `logits_to_keep` positions only, where > 0), the cache holding their K/V too, and with
        `labels` [B, n] the mean next-token cross-entropy (labels -100 ignored).
        attention_mask [B, P + n] marks real tokens (padding on either side); position_ids
        [B, n] default to the number of real tokens before each. `max_loops`: the depth of
        tokens appended to a cache (module docstring). `token_type_ids`, which some tokenizers
        return, are ignored: Ouro has one segment."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("Ouro's transformers model takes input_ids (not inputs_embeds)")
        ouro = self.core()
        depth = ouro.num_loops if max_loops is None else max_loops
        if not 1 <= depth <= ouro.num_loops:
            raise ValueError(f"max_loops must lie in 1..{ouro.num_loops}, got {max_loops}")
        cache = cache if cache is not None else past_key_values
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        past = cache.get_seq_length() if cache is not None else 0
        if depth < ouro.num_loops and not use_cache:
            raise ValueError("max_loops < T needs use_cache=True: without the cache the prompt is not told apart")
        positions = _positions(input_ids, attention_mask, position_ids, past)
        keep = input_ids.shape[1] if not logits_to_keep else min(logits_to_keep, input_ids.shape[1])
        if past == 0:
            logits, planes = _full_depth(ouro, input_ids, attention_mask, positions, keep, use_cache)
        else:
            logits, planes = _appended(ouro, input_ids, attention_mask, positions, keep, cache, depth)
        if use_cache:
            cache = DynamicCache() if cache is None else cache
            for layer, layer_planes in enumerate(planes):
                cache.update(*_stacked(layer_planes), layer)
        loss = None if labels is None else _next_token_loss(logits, labels)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})


def _positions(input_ids, attention_mask, position_ids, past: int) -> torch.Tensor:
    """RoPE positions [B, n] of the n new tokens: given, else the number of real tokens
    before each (padding: 0), else past, past + 1, ..."""
    if position_ids is not None:
        return position_ids.expand(input_ids.shape)
    n = input_ids.shape[1]
    if attention_mask is None:
        return torch.arange(past, past + n, device=input_ids.device).expand(input_ids.shape)
    counted = attention_mask.long().cumsum(-1) - 1
    return counted.masked_fill(attention_mask == 0, 0)[:, -n:]


def _full_depth(ouro, input_ids, attention_mask, positions, keep: int, collect: bool) -> tuple[torch.Tensor, list]:
    """The whole sequence at full depth T through our model's forward: the logits of its last
    `keep` positions [B, keep, V] and, where `collect`, every layer's T planes."""
    b, s = input_ids.shape
    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def kv_sink(loop: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kv[loop, layer] = (k, v)

    rows = torch.arange(b, device=input_ids.device).repeat_interleave(keep)
    cols = torch.arange(s - keep, s, device=input_ids.device).repeat(b)
    mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask
    logits = ouro.forward(
        input_ids,
        attention_mask=mask,
        position_ids=positions,
        kv_sink=kv_sink if collect else None,
        logits_at=(rows, cols),
    )
    loops, layers = range(1, ouro.num_loops + 1), range(len(ouro.model.layers))
    planes = [[kv[t, i] for t in loops] for i in layers] if collect else []
    return logits.view(b, keep, -1), planes


def _appended(ouro, input_ids, attention_mask, positions, keep: int, cache, depth: int) -> tuple[torch.Tensor, list]:
    """The n tokens after the cache's P tokens at `depth` loops through `run_loop`, each
    loop's queries attending to that loop's cached plane and to the new keys: the logits of
    the last `keep` [B, keep, V] and every layer's T planes for the new tokens, planes past
    `depth` holding plane `depth` (last-exited K/V)."""
    b, n = input_ids.shape
    layers = range(len(ouro.model.layers))
    cached = [_unstacked(*_cached(cache, i), ouro.num_loops) for i in layers]
    mask = _appended_mask(attention_mask, b, cache.get_seq_length(), n, input_ids.device)
    new: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def attend_at(loop: int, layer: int):
        past_k, past_v = cached[layer][loop - 1]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            new[loop, layer] = (k, v)
            return dense_attention(q, torch.cat([past_k, k], 1), torch.cat([past_v, v], 1), mask)

        return attend

    h = ouro.embed(input_ids)
    cos, sin = ouro.rope(positions, h.dtype)
    for loop in range(1, depth + 1):
        h = ouro.run_loop(h, cos, sin, lambda layer, loop=loop: attend_at(loop, layer))
    planes = [[new[min(t, depth), i] for t in range(1, ouro.num_loops + 1)] for i in layers]
    return ouro.logits(h[:, n - keep :]), planes


def _appended_mask(attention_mask, batch: int, past: int, n: int, device) -> torch.Tensor:
    """[B, 1, n, P + n] (True = attend): new token j sees the real cached tokens and the new
    ones up to itself."""
    keys = torch.arange(past + n, device=device)
    causal = keys[None, :] <= past + torch.arange(n, device=device)[:, None]
    if attention_mask is None:
        return causal.expand(batch, 1, n, past + n)
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


def _cached(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s cached keys and values [B, T·Hkv, P, D]."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _stacked(planes: Planes) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's T planes as the cache stores them: keys and values [B, T·Hkv, S, D]."""
    return tuple(torch.cat([plane[j].transpose(1, 2) for plane in planes], 1) for j in (0, 1))


def _unstacked(keys: torch.Tensor, values: torch.Tensor, num_loops: int) -> Planes:
    """`_stacked`'s inverse: a layer's T planes."""
    ks, vs = (x.chunk(num_loops, 1) for x in (keys, values))
    return [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in zip(ks, vs, strict=True)]


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of position j's logits against labels[j + 1] in fp32 (-100 ignored)."""
    return nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
    )
