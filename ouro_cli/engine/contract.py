"""The rollout-engine contract: what the trainer may ask of any engine and what it gets back.

`SamplingParams` and `RequestOutput` are plain dataclasses and `RolloutEngine` is a
typed, runtime-checkable Protocol, so an adapter to another engine (a vLLM-family
server, a PD coordinator) only has to return these objects and implement these
methods; the conformance tests in tests/unit/engine run against any factory.

Semantics are those of docs/model.md §3–5: prefill at full depth T, decode at 1..K loops
per token, `exit_depths[0] == T`, raw/processed log-probabilities, per-request seeds
reported back, and the start/update/finish weight publication on an idle engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

ExitMode = Literal["immediate", "delayed", "trace"]
LogprobsMode = Literal["raw", "processed"]
FinishReason = Literal["stop", "length", "abort"]


class EngineError(RuntimeError):
    """Base class for everything an engine refuses or fails to do."""


class RequestRejected(EngineError, ValueError):
    """A request that can never run on this engine (too long for the KV cache or the model)."""


class EngineBusy(EngineError):
    """The engine cannot take the call now: an update is in progress, it is paused, or not idle."""


class PublicationError(EngineError):
    """A weight update was refused (bad version, names, shapes, incomplete) or left weights unusable."""


class GenerationBlocked(EngineError):
    """The weights are not a committed version (a publication failed or is incomplete)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and how deep each decoded token runs.

    Depth: every decoded token runs between `min_loops` and `max_loops` (K, default T)
    loops. With `exit_threshold` τ < 1 it exits after the first loop t ≥ min_loops whose
    exit CDF reaches τ ("immediate"), or, in "delayed" mode, the signal of loop t takes
    effect after loop t + 1 (exit depth min(t + 1, K)), as an asynchronous scheduler
    would see it. τ = 1 means exactly K loops. "trace" replays `exit_trace[j-1]` as the
    depth of generated token j (tokens past the trace run K loops); it exists for tests.

    Self-speculation (`speculative_tokens` N > 0, speculative.py): each step drafts up to
    N tokens at `draft_loops` loops and verifies them at full depth T; the emitted tokens
    are distributed exactly as full-depth sampling and report depth T. It needs K = T
    and no threshold exits (τ = 1, exit_mode "immediate").
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    logprobs: int | None = None
    logprobs_mode: LogprobsMode = "processed"
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_loops: int = 1
    max_loops: int | None = None
    exit_threshold: float = 1.0
    exit_mode: ExitMode = "immediate"
    exit_trace: tuple[int, ...] | None = None
    speculative_tokens: int = 0
    draft_loops: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.exit_trace is not None:
            object.__setattr__(self, "exit_trace", tuple(int(d) for d in self.exit_trace))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.logprobs not in (None, 0):
            raise ValueError(f"logprobs must be None or 0 (the sampled token only), got {self.logprobs}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if self.exit_mode not in ("immediate", "delayed", "trace"):
            raise ValueError(f"exit_mode must be 'immediate', 'delayed' or 'trace', got {self.exit_mode!r}")
        if self.exit_mode == "trace" and self.exit_trace is None:
            raise ValueError("exit_mode='trace' needs exit_trace (the depth of each generated token after the first)")
        if not 0.0 < self.exit_threshold <= 1.0:
            raise ValueError(f"exit_threshold must lie in (0, 1], got {self.exit_threshold}")
        if self.min_loops < 1:
            raise ValueError(f"min_loops must be >= 1, got {self.min_loops}")
        if self.max_loops is not None and self.max_loops < self.min_loops:
            raise ValueError(f"max_loops ({self.max_loops}) must be >= min_loops ({self.min_loops})")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must lie in [0, 2**63), got {self.seed}")
        if self.speculative_tokens < 0 or self.draft_loops < 1:
            raise ValueError(
                f"speculative_tokens must be >= 0 and draft_loops >= 1, got {self.speculative_tokens} "
                f"and {self.draft_loops}"
            )
        if self.speculative_tokens and (self.exit_threshold < 1.0 or self.exit_mode != "immediate"):
            raise ValueError(
                "speculative_tokens needs exit_threshold=1 and exit_mode='immediate': the draft is "
                "verified at full depth T, so threshold, delayed or traced exits cannot apply"
            )

    def resolved(self, num_loops: int, seed: int) -> SamplingParams:
        """These params with K and the seed made explicit, checked against the model's T."""
        max_loops = num_loops if self.max_loops is None else self.max_loops
        if max_loops > num_loops:
            raise ValueError(f"max_loops ({max_loops}) exceeds the model's total_ut_steps ({num_loops})")
        if self.min_loops > max_loops:
            raise ValueError(f"min_loops ({self.min_loops}) exceeds max_loops ({max_loops})")
        if self.exit_trace is not None and any(not 1 <= d <= num_loops for d in self.exit_trace):
            raise ValueError(f"exit_trace depths must lie in 1..{num_loops}")
        if self.speculative_tokens and max_loops != num_loops:
            raise ValueError(
                f"speculative_tokens needs max_loops = T = {num_loops} (verification runs every loop), "
                f"got max_loops={max_loops}"
            )
        if self.speculative_tokens and self.draft_loops > num_loops:
            raise ValueError(f"draft_loops ({self.draft_loops}) exceeds the model's total_ut_steps ({num_loops})")
        return dataclasses.replace(self, max_loops=max_loops, seed=self.seed if self.seed is not None else seed)


@dataclass
class RequestOutput:
    """One finished request. `log_probs[j]` scores `output_token_ids[j]` (None unless asked).

    `exit_depths[0]` is T (token 0 came from the full-depth prefill); `exit_depths[j]` is
    the number of loops run on input token j-1 to produce token j (docs/model.md §3).
    `sampling_params` are the effective ones: K resolved and the seed actually used.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    exit_depths: list[int]
    log_probs: list[float] | None
    finish_reason: FinishReason
    weight_version: int
    sampling_params: SamplingParams
    text: str | None = None
    prompt: str | None = None


Prompt = str | Sequence[int]
WeightChunk = Iterable[tuple[str, torch.Tensor]]


@runtime_checkable
class RolloutEngine(Protocol):
    """What `ouro train` needs from a rollout engine (docs/model.md §3–5).

    - `generate` returns one output per prompt, in input order; `params` is one
      SamplingParams for all prompts or a sequence with one per prompt.
    - Publication: `start_weight_update(version)` (idle engine only, version greater
      than any attempted before; invalidates cached KV), `update_weights(chunk)` any
      number of times (each chunk fully checked before anything is copied; in place),
      `finish_weight_update()` (every physical tensor exactly once, then commit).
      Until a full update commits after a failure, `generate` raises GenerationBlocked.
    - `pause_generation`/`resume_generation` hold in-flight requests at a step boundary
      (or end them with finish_reason "abort"); `close` releases the engine.
    - `work_counters` reports layer-token evaluations for metrics (may be empty).
    """

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]: ...

    def start_weight_update(self, version: int) -> None: ...

    def update_weights(self, chunk: WeightChunk) -> None: ...

    def finish_weight_update(self) -> None: ...

    def get_weight_version(self) -> int: ...

    def pause_generation(self, abort: bool = False) -> None: ...

    def resume_generation(self) -> None: ...

    def work_counters(self) -> Mapping[str, int]: ...

    def close(self) -> None: ...


@dataclass
class GenerateProgress:
    """Where an engine's current `generate` call stands, for a display to read from another
    thread: the calls begun so far, and of the current one its requests, those finished, the
    tokens decoded and the most it may decode (the requests' max_tokens summed). The engine
    only assigns these counters (once per call and per scheduler step); it never waits for a
    reader."""

    calls: int = 0
    sequences: int = 0
    finished: int = 0
    tokens: int = 0
    max_tokens: int = 0


@runtime_checkable
class ReportsProgress(Protocol):
    """An engine whose `generate` keeps `generate_progress` current (`GenerateProgress`);
    engines without it simply report nothing while they generate."""

    generate_progress: GenerateProgress


@runtime_checkable
class ReleasesMemory(Protocol):
    """An engine that can hand its KV memory to a colocated trainer between rollouts.

    `release_memory()` (idle engine only) frees the KV cache; nothing cached survives,
    which costs nothing in RL because every publication invalidates it anyway.
    `restore_memory()` takes it back; `generate` also restores it on its own. Engines
    without the methods simply keep their memory."""

    def release_memory(self) -> None: ...

    def restore_memory(self) -> None: ...


@runtime_checkable
class LimitsMemory(ReleasesMemory, Protocol):
    """An engine whose KV cache can be held below its capacity: `limit_kv_blocks(n)` makes
    every later `generate` take at most n blocks (counted at T planes; None: the capacity)
    when it restores its cache, so that a colocated run survives an out-of-memory by asking
    for less (rl/recovery.py). Sequences that do not fit wait or are preempted, as in any
    cache too small for a whole call; `min_kv_blocks(seq_tokens, planes)` is the least that
    still holds one sequence."""

    def limit_kv_blocks(self, blocks: int | None) -> None: ...

    def min_kv_blocks(self, seq_tokens: int, planes: int) -> int: ...
