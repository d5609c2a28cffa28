"""What every engine front end sets up the same way: the model, the tokenizer, the sizes, the EOS set.

The in-process `LLM` (through its `EngineCore`) and the prefill/decode coordinator
`PDEngine` open their model with `open_model`, size their requests and KV cache with
`EngineLimits`, and stop on `eos_token_ids`, so a checkpoint path, a tokenizer or a
`kv_blocks` means the same to both, and a request one of them rejects the other rejects
too. `ouro train` stops on the same EOS set (`rl/loop.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .kv_cache import blocks_needed
from .tokenizer import TextCodec

DEFAULT_CONTEXT_PER_SEQ = 2048  # sizes the default KV cache: max_num_seqs sequences of this length


def open_model(
    model: str | Path | nn.Module,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
) -> tuple[nn.Module, TextCodec | None]:
    """-> (model, codec). A checkpoint path (HF directory, Megatron checkpoint or run
    directory) is loaded on `device` (default CPU) in `dtype`; a loaded OuroForCausalLM is
    moved there when either is given. The codec wraps `tokenizer` when given, else the
    checkpoint's tokenizer.json; None for a module without a tokenizer (token ids only)."""
    codec = TextCodec(tokenizer) if tokenizer is not None else None
    if isinstance(model, (str, Path)):
        from ouro_cli.checkpoint import open_checkpoint
        from ouro_cli.model import load

        path = Path(model)
        model = load(path, dtype=dtype, device=device or "cpu")
        codec = codec or TextCodec.from_dir(open_checkpoint(path).assets_dir)  # HF dir or hf_assets/
    elif device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a checkpoint path or an OuroForCausalLM, got {type(model).__name__}")
    return model, codec


def eos_token_ids(config: Any) -> frozenset[int]:
    """The config's `eos_token_id` (None, one id or a list) as a set of ids."""
    eos = config.eos_token_id
    return frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)


@dataclass(frozen=True)
class EngineLimits:
    """The sizes requests are checked against and a decode cache is built with.

    `kv_blocks` × `block_size` tokens of KV at T planes; by default enough for
    `max_num_seqs` sequences of min(max_model_len, 2048) tokens. `max_model_len` defaults
    to the config's max_position_embeddings; `max_prefill_tokens` is one step's prefill
    budget."""

    max_num_seqs: int
    block_size: int
    max_model_len: int
    max_prefill_tokens: int
    kv_blocks: int

    @classmethod
    def resolve(
        cls,
        config: Any,
        *,
        max_num_seqs: int = 64,
        kv_blocks: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 8192,
    ) -> EngineLimits:
        """The limits with their defaults filled in from `config`, checked."""
        if max_num_seqs < 1 or block_size < 1 or max_prefill_tokens < 1:
            raise ValueError("max_num_seqs, block_size and max_prefill_tokens must be >= 1")
        max_model_len = max_model_len or config.max_position_embeddings
        if kv_blocks is None:
            kv_blocks = max_num_seqs * blocks_needed(min(max_model_len, DEFAULT_CONTEXT_PER_SEQ), block_size)
        if kv_blocks < 1:
            raise ValueError(f"kv_blocks must be >= 1, got {kv_blocks}")
        return cls(
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            max_model_len=max_model_len,
            max_prefill_tokens=max_prefill_tokens,
            kv_blocks=kv_blocks,
        )
