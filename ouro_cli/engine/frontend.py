"""What every engine front end does the same way: admission, pausing, request intake, outputs.

Both the in-process `LLM` and the prefill/decode coordinator `PDEngine` take requests
through here, so the contract's rules exist once: one `generate` at a time, none during
a weight update or a pause, none after a failed publication; prompts checked (text needs
a tokenizer, ids within the vocabulary, non-empty), params resolved against T with a
drawn seed when none is given, and a request that could never fit in the KV cache
rejected up front instead of deadlocking the scheduler.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from .contract import (
    EngineBusy,
    EngineError,
    Prompt,
    RequestOutput,
    RequestRejected,
    SamplingParams,
)
from .kv_cache import blocks_needed
from .publication import WeightPublisher


class Admission:
    """One engine's admission and pause/abort state, and the contract's rules over it.

    `lock` (a Condition) guards every field; `generating`, `paused`, `aborting` and
    `closed` are read and set under it. `check` is the front end's own reason to refuse
    every call (the PD coordinator's failed worker), asked before `closed`."""

    def __init__(self, publisher: WeightPublisher, check: Callable[[], None] | None = None) -> None:
        self.publisher, self.check = publisher, check
        self.lock = threading.Condition()
        self.generating = self.paused = self.aborting = self.closed = False

    def check_open(self) -> None:
        if self.check is not None:
            self.check()
        if self.closed:
            raise EngineError("the engine is closed")

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """The body of one `generate` call, admitted by the contract's rules."""
        with self.lock:
            self.check_open()
            if self.generating:
                raise EngineBusy("generate is already running on this engine")
            if self.publisher.in_progress:
                raise EngineBusy("a weight update is in progress; requests are not admitted")
            if self.paused:
                raise EngineBusy("generation is paused; call resume_generation() first")
            self.publisher.check_usable()
            self.generating = True
        try:
            yield
        finally:
            with self.lock:
                self.generating = False
                self.lock.notify_all()

    def check_idle_for_update(self) -> None:
        """Under `lock`: weights may change only while open and idle."""
        self.check_open()
        if self.generating:
            raise EngineBusy("weights can only be updated on an idle engine (generate is running)")

    def pause(self, abort: bool = False) -> None:
        """Hold in-flight requests at the next step boundary; with `abort`, end them and wait
        until the engine is idle."""
        with self.lock:
            self.paused = True
            self.aborting = self.aborting or abort
            self.lock.notify_all()
            if abort:
                while self.generating:
                    self.lock.wait()

    def resume(self) -> None:
        with self.lock:
            self.paused = self.aborting = False
            self.lock.notify_all()

    def requested(self) -> tuple[bool, bool]:
        """(paused, aborting) now; never blocks."""
        with self.lock:
            return self.paused, self.aborting

    def pause_requested(self) -> bool:
        """Whether a pause (or abort) waits for the next step boundary; never blocks."""
        with self.lock:
            return self.paused or self.aborting

    def hold_at_step_boundary(self) -> bool:
        """Block while paused; True when the in-flight requests must be aborted."""
        with self.lock:
            while self.paused and not self.aborting:
                self.lock.wait()
            return self.aborting


class GenerationControl:
    """The contract's pause and resume, for a front end that keeps its `Admission` in `control`."""

    control: Admission

    def pause_generation(self, abort: bool = False) -> None:
        """Hold in-flight requests at the next step boundary; with `abort`, end them
        (finish_reason "abort", partial outputs returned) and wait until the engine is idle."""
        self.control.pause(abort)

    def resume_generation(self) -> None:
        self.control.resume()


@dataclass
class Intake:
    """One accepted request: token ids, effective params, and the KV it may ever need."""

    index: int
    request_id: str
    ids: list[int]
    params: SamplingParams
    text: str | None
    kv_tokens: int


def take_requests(
    prompts: Seq[Prompt],
    params: SamplingParams | Seq[SamplingParams] | None,
    *,
    codec,
    vocab_size: int,
    num_loops: int,
    seeds: random.Random,
    first_id: int,
    max_model_len: int,
    block_size: int,
    kv_blocks: int,
    cache_name: str = "the cache",
    adjust: Callable[[SamplingParams, int], SamplingParams] | None = None,
) -> list[Intake]:
    if isinstance(prompts, str) or not isinstance(prompts, Seq):
        raise TypeError("prompts must be a list of token-id lists or strings")
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    accepted = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        text = None
        if isinstance(prompt, str):
            if codec is None:
                raise RequestRejected(f"prompt {i} is text but the engine has no tokenizer; pass token ids")
            text, prompt = prompt, codec.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise RequestRejected(f"prompt {i} is empty")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise RequestRejected(f"prompt {i} has token ids outside 0..{vocab_size - 1}")
        try:
            p = p.resolved(num_loops, seeds.randrange(2**63))
        except ValueError as err:
            raise RequestRejected(f"request {i}: {err}") from err
        if adjust is not None:
            p = adjust(p, i)
        if len(ids) + p.max_tokens > max_model_len:
            raise RequestRejected(
                f"request {i}: prompt ({len(ids)}) + max_tokens ({p.max_tokens}) exceeds "
                f"max_model_len ({max_model_len})"
            )
        kv_tokens = len(ids) + p.max_tokens - 1
        if blocks_needed(kv_tokens, block_size) > kv_blocks:
            raise RequestRejected(
                f"request {i} can never fit: it needs KV for {kv_tokens} tokens "
                f"({blocks_needed(kv_tokens, block_size)} blocks of {block_size}) but {cache_name} holds "
                f"{kv_blocks * block_size} tokens ({kv_blocks} blocks); raise kv_blocks or lower max_tokens"
            )
        accepted.append(Intake(i, str(first_id + i), ids, p, text, kv_tokens))
    return accepted


def make_output(
    *,
    request_id: str,
    prompt: list[int],
    output: list[int],
    depths: list[int],
    logprobs: list[float],
    finish_reason: str | None,
    params: SamplingParams,
    version: int,
    codec,
    text_prompt: str | None,
) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        exit_depths=list(depths),
        log_probs=list(logprobs) if params.logprobs is not None else None,
        finish_reason=finish_reason or "abort",
        weight_version=version,
        sampling_params=params,
        text=codec.decode(output) if codec is not None else None,
        prompt=text_prompt,
    )
