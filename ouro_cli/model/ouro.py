"""Ouro in PyTorch: one stack of layers applied up to T times per token (docs/model.md §2–3).

`OuroForCausalLM` owns the parameters under their physical Hugging Face names
(`model.layers.{i}...`, `model.norm`, `model.early_exit_gate`, `lm_head`): the
loops never duplicate a tensor. Two ways to run it share the same layer code:

- `forward(input_ids, depths=...)`: the whole sequence at once with a per-position
  depth vector. Loop t runs on positions whose depth ≥ t; every other position keeps
  the hidden state and the K/V of its own last loop ("last-exited" semantics), and
  logits are read at each position from its own last loop. This is the trainer's
  replay and the engine's prefill; no depths means full depth T everywhere.
- `run_loop(h, cos, sin, attend_for_layer)`: one loop for the caller's tokens with
  the caller's attention (the engine's paged KV cache drives decoding this way).

Masked positions are still computed and then discarded with `torch.where`; this
keeps shapes static and the replay exactly equal to per-token execution. Counting
that work (incl. padding) is the trainer's concern.

`execution` (ouro_cli/settings.py) says how the model computes on a GPU: whether its
elementwise math compiles, whole layer calls as regions or not, and which attention the
replay uses. Both entry points run under it; whoever runs the model sets it (the trainer,
the engine), and a model built without it has the defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import exact, pointwise
from .attention import SequenceLayout, dense_attention
from .config import OuroConfig
from .layers import Attend, DecoderLayer, RMSNorm, Rotary
from .matmul import linear

if TYPE_CHECKING:
    from ouro_cli.settings import ExecutionSettings


class OuroModel(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)
        self.rotary_emb = Rotary(config.dim_per_head, config.rope_theta)


class OuroForCausalLM(nn.Module):
    def __init__(self, config: OuroConfig, execution: ExecutionSettings | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = OuroModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.execution = execution or pointwise.DEFAULTS

    @property
    def num_loops(self) -> int:
        return self.config.total_ut_steps

    # ---- pieces shared by every execution path -------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.rotary_emb(position_ids, dtype)

    def run_loop(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend_for_layer: Callable[[int], Attend],
    ) -> torch.Tensor:
        """One pass through the layer stack, closed by `model.norm` (the loop's exit state)."""
        with pointwise.executing(self.execution):
            x = self.model.layers[0].input_layernorm(h)
            for i, (layer, closing) in enumerate(zip(self.model.layers, self.closing_norms(), strict=True)):
                h, x = layer(h, x, cos, sin, attend_for_layer(i), closing)
        return x

    def closing_norms(self) -> list[torch.Tensor]:
        """The norm weight each layer's closing kernel applies after its residual add: the next
        layer's input norm, and `model.norm` after the last layer (DecoderLayer.forward)."""
        layers = self.model.layers
        return [layer.input_layernorm.weight for layer in layers[1:]] + [self.model.norm.weight]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.lm_head.weight)

    def exit_lambda(self, h: torch.Tensor) -> torch.Tensor:
        """λ_t = sigmoid(gate(h_t)) in fp32, shape h.shape[:-1]."""
        gate = self.model.early_exit_gate
        if self.execution.exact:  # a token's exit must not depend on its batch-mates either
            return exact.exit_lambda(h, gate.weight, gate.bias)
        return torch.sigmoid(gate(h).float()).squeeze(-1)

    # ---- whole-sequence forward with per-position depths ---------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        depths: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        recompute: bool = False,
        logits_at: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_sink: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None,
        state_sink: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """input_ids [B,S] -> logits [B,S,V], or [N,V] at `logits_at` = (rows [N], cols [N]) only
        (the trainer scores response tokens: the prompt's logits are never computed).

        depths [B,S] (ints in 1..T; None = T everywhere) selects each position's loops.
        attention_mask [B,S] marks real tokens (padding on either side); document_ids
        [B,S] packs several sequences in a row (no attention across documents, RoPE
        positions restart per document). `recompute` re-runs each layer call in the
        backward pass instead of keeping its activations. `kv_sink(loop, layer, k, v)`
        receives the K/V every position holds at each (loop, layer) — its last-exited
        version — which is what the engine writes into its KV planes after prefill.
        `state_sink(loop, h)` receives loop t's exit state `model.norm(...)` [B,S,H] for every
        position (exited ones included, before they are masked out): what the exit gate reads.
        (`model.norm` runs fused into the last layer's closing kernel, so a module hook on it
        would never fire.)
        """
        with pointwise.executing(self.execution):
            return self._forward(input_ids, depths, attention_mask, document_ids, position_ids, recompute, logits_at,
                                 kv_sink, state_sink)

    def _forward(self, input_ids, depths, attention_mask, document_ids, position_ids, recompute, logits_at, kv_sink,
                 state_sink) -> torch.Tensor:
        layout = SequenceLayout.build(input_ids, attention_mask, document_ids, position_ids)
        h = self.embed(input_ids)
        cos, sin = self.rope(layout.position_ids, h.dtype)
        num_loops = self.num_loops
        if depths is not None:
            depths = _check_depths(depths, input_ids.shape, num_loops)
            num_loops = int(depths.max())
        prev_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.model.layers)
        # one compiled region per layer call (compile_layers); bound to the settings, for recompute's re-run
        step = pointwise.under(pointwise.region(_layer_step, h), self.execution)
        for t in range(1, num_loops + 1):
            active = None if depths is None or bool((depths >= t).all()) else (depths >= t)
            first = self.model.layers[0].input_layernorm
            x, normed = h, pointwise.rms_norm_generic(h, first.weight, first.eps)
            for i, (layer, closing) in enumerate(zip(self.model.layers, self.closing_norms(), strict=True)):
                args = (layer, layout.mask, closing, x, normed, cos, sin, active, *(prev_kv[i] or (None, None)))
                x, normed, k, v = checkpoint(step, *args, use_reentrant=False) if recompute else step(*args)
                prev_kv[i] = (k, v)
                if kv_sink is not None:
                    kv_sink(t, i, k, v)
            # `normed` is now model.norm(x): the loop's exit state
            if state_sink is not None:
                state_sink(t, normed)
            h = normed if active is None else torch.where(active[..., None], normed, h)
        if kv_sink is not None:
            for t in range(num_loops + 1, self.num_loops + 1):  # planes past everyone's depth
                for i, kv in enumerate(prev_kv):
                    kv_sink(t, i, *kv)
        return self.logits(h if logits_at is None else h[logits_at])


def _layer_step(layer: DecoderLayer, mask: torch.Tensor | None, closing: torch.Tensor, x, normed, cos, sin,
                active, prev_k, prev_v):
    """One layer call of the replay: mixes in last-loop K/V for positions that exited.

    A position inactive at loop t contributes the K/V it produced at its own last loop
    (`prev_k`, `prev_v` already hold that version); its own hidden state is discarded
    by the caller. Returns the layer output, its closing norm (DecoderLayer.forward) and the
    K/V actually attended to. A function of its arguments only, so that one compiled
    region serves every layer and loop (pointwise.region).
    """
    used: dict[str, torch.Tensor] = {}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if active is not None:
            keep = active[:, :, None, None]
            k, v = torch.where(keep, k, prev_k), torch.where(keep, v, prev_v)
        used["k"], used["v"] = k, v
        return dense_attention(q, k, v, mask)

    out, out_normed = layer(x, normed, cos, sin, attend, closing)
    return out, out_normed, used["k"], used["v"]


def _check_depths(depths: torch.Tensor, shape: torch.Size, num_loops: int) -> torch.Tensor:
    if depths.shape != shape:
        raise ValueError(f"depths has shape {tuple(depths.shape)}, expected {tuple(shape)}")
    lo, hi = int(depths.min()), int(depths.max())
    if lo < 1 or hi > num_loops:
        raise ValueError(f"depths must lie in 1..{num_loops}, got {lo}..{hi}")
    return depths.long()
