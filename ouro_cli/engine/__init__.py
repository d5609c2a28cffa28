"""The rollout engine: Ouro's per-token loop depths behind the training contract.

    from ouro_cli.engine import LLM, SamplingParams
    llm = LLM(model, device="cuda", dtype=torch.bfloat16, max_num_seqs=64, kv_blocks=4096, block_size=16)
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=64, max_loops=3, logprobs=0))

Modules: contract (the Protocol and dataclasses every engine speaks), engine (`LLM`,
the user facade), core (`EngineCore`: the model, cache, runner and weights, and the
public step methods that `LLM`, self-speculation and the PD decode worker drive),
setup (model loading, sizes and the EOS set every front end shares), frontend
(admission, pausing, request intake), kv_cache (paged per-loop planes), paged_attention
(batch-invariant decode attention), scheduler (continuous batching, preemption), runner
(prefill and decode on the shared model code, CUDA graphs), exits (exit policies),
sampling, speculative (self-speculation), async_exits, publication (weight updates),
tokenizer (text in and out), factory (`--engine DOTTED.PATH`), pd/ (prefill/decode
workers), kernels/ (Triton).
"""

from .contract import (
    EngineBusy,
    EngineError,
    GenerationBlocked,
    PublicationError,
    RequestOutput,
    RequestRejected,
    RolloutEngine,
    SamplingParams,
)
from .engine import LLM
from .factory import DEFAULT_FACTORY, load_factory, make_engine

__all__ = [
    "DEFAULT_FACTORY",
    "LLM",
    "EngineBusy",
    "EngineError",
    "GenerationBlocked",
    "PublicationError",
    "RequestOutput",
    "RequestRejected",
    "RolloutEngine",
    "SamplingParams",
    "load_factory",
    "make_engine",
]
