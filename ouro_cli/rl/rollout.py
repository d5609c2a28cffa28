"""The rollout stage of a GRPO update: prompts × group → engine outputs → checked samples.

Every request gets its own seed derived from (run seed, update, sample index), the index
counting over the update's global batch (prompt position × group size + member), so a
rollout replays bit for bit whatever the engine's batching and whichever rank draws it:
N data-parallel ranks sample exactly what one rank samples for the same global batch. Each output is checked
against the contract before anything trains on it: the committed policy version,
`exit_depths[0] == T`, depths within 1..K, and every GRPO group one prompt, one K, one
version and one execution-config hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ouro_cli.engine import SamplingParams

from .data import Row
from .schedule import config_hash, execution_settings, validate_group


class RolloutCheckFailed(RuntimeError):
    """An engine output breaks the execution contract (version, depths, group)."""


def request_seed(seed: int, update: int, index: int, purpose: str = "rollout") -> int:
    # The ":0:" held the drawing rank once; it stays so single-rank runs keep their seeds.
    digest = hashlib.sha256(f"{purpose}:{seed}:{update}:0:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class RolloutSample:
    row: Row
    group: int
    prompt_ids: list[int]
    response_ids: list[int]
    exit_depths: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    seed: int
    k: int
    config_hash: str
    text: str
    reward: float = 0.0  # the reward function's (raw)
    penalty: float = 0.0  # --overlong soft's length penalty, added to the reward for the advantage
    advantage: float = 0.0
    trained: bool = True  # False: its group was filtered or not needed, or --overlong mask left it out
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_id(self) -> Any:
        return self.row.problem_id

    def record(self, update: int) -> dict[str, Any]:
        """What rollouts/update_N.jsonl keeps (logprobs as exact float reprs), with the row's
        label as the reward got it (after --label-parser)."""
        return {
            "update": update,
            "problem_id": self.row.problem_id,
            "label": self.row.label,
            "group": self.group,
            "k": self.k,
            "weight_version": self.weight_version,
            "seed": self.seed,
            "config_hash": self.config_hash,
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "exit_depths": self.exit_depths,
            "logprobs": [float(x).hex() for x in self.logprobs],
            "finish_reason": self.finish_reason,
            "reward": self.reward,
            "length_penalty": self.penalty,
            "advantage": self.advantage,
            "trained": self.trained,
            "text": self.text,
        }


@dataclass(frozen=True)
class RolloutSampling:
    """How every request of a run's rollouts, or of an evaluation, is sampled and checked:
    fixed for the run, while K, the seeds and the group vary per call (`generate_groups`)."""

    num_loops: int  # T: the prefill depth every output must report
    seed: int  # the seed the request seeds derive from (`request_seed`)
    temperature: float
    max_tokens: int
    exit_threshold: float
    min_loops: int
    stop_token_ids: tuple[int, ...]
    decode: Callable[[list[int]], str]  # response ids -> the text the reward grades
    speculative_tokens: int = 0
    async_scheduling: bool = False  # how the engine was built (part of the config hash)

    @classmethod
    def of(
        cls,
        options,
        *,
        num_loops: int,
        seed: int,
        stop_token_ids: Sequence[int],
        decode: Callable[[list[int]], str],
        speculative_tokens: int = 0,
        async_scheduling: bool = False,
    ) -> RolloutSampling:
        """From the run's `SamplingOptions` (rl/options.py) and what the model and the engine fix."""
        return cls(
            num_loops=num_loops,
            seed=seed,
            temperature=options.temperature,
            max_tokens=options.max_response_len,
            exit_threshold=options.exit_threshold,
            min_loops=options.min_loops,
            stop_token_ids=tuple(stop_token_ids),
            decode=decode,
            speculative_tokens=speculative_tokens,
            async_scheduling=async_scheduling,
        )

    def params(self, k: int, seed: int) -> SamplingParams:
        """The engine request of one sample at decode budget `k`."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=seed,
            logprobs=0,
            logprobs_mode="processed",
            stop_token_ids=self.stop_token_ids,
            min_loops=min(self.min_loops, k),
            max_loops=k,
            exit_threshold=self.exit_threshold,
            speculative_tokens=self.speculative_tokens,
        )


def generate_groups(
    engine,
    rows: Sequence[Row],
    prompt_ids: Sequence[list[int]],
    sampling: RolloutSampling,
    *,
    group_size: int,
    k: int,
    update: int,
    positions: Sequence[int] | None = None,
    purpose: str = "rollout",
    seeds: Sequence[int] | None = None,
) -> list[RolloutSample]:
    """One request per (row, group member); returns checked samples in (row, member) order.

    `positions` are the rows' places in the update's global batch (default 0, 1, …): they
    pick the seeds and become each sample's `group`, so records from several ranks sort
    back into the global order. `seeds`, one per (row, member) in that order, replace the
    seeds derived from (update, position) (evaluate.py seeds by prompt and sample)."""
    positions = list(range(len(rows))) if positions is None else list(positions)
    if len(positions) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(positions)} batch positions")
    if seeds is not None and len(seeds) != len(rows) * group_size:
        raise ValueError(f"{len(rows)} rows of {group_size} samples but {len(seeds)} seeds")
    params, owners = [], []
    for i, row in enumerate(rows):
        for g in range(group_size):
            seed = (
                request_seed(sampling.seed, update, positions[i] * group_size + g, purpose)
                if seeds is None
                else seeds[i * group_size + g]
            )
            params.append(sampling.params(k, seed))
            owners.append((row, positions[i], list(prompt_ids[i])))
    outputs = engine.generate([o[2] for o in owners], params)
    committed = engine.get_weight_version()
    samples = []
    for (row, group, prompt), out in zip(owners, outputs, strict=True):
        eff = out.sampling_params
        _check_output(out, committed, sampling.num_loops, k)
        settings = execution_settings(
            eff,
            prefill_depth=sampling.num_loops,
            async_scheduling=sampling.async_scheduling,
            speculative_tokens=eff.speculative_tokens,
        )
        samples.append(
            RolloutSample(
                row=row,
                group=group,
                prompt_ids=prompt,
                response_ids=list(out.output_token_ids),
                exit_depths=list(out.exit_depths),
                logprobs=[float(x) for x in out.log_probs],
                finish_reason=out.finish_reason,
                weight_version=out.weight_version,
                seed=eff.seed,
                k=eff.max_loops,
                config_hash=config_hash(settings),
                text=sampling.decode(list(out.output_token_ids)),
            )
        )
    for group in range(len(rows)):
        try:
            validate_group(samples[group * group_size : (group + 1) * group_size])
        except ValueError as err:
            raise RolloutCheckFailed(str(err)) from err
    return samples


def _check_output(out, committed: int, num_loops: int, k: int) -> None:
    if out.weight_version != committed:
        raise RolloutCheckFailed(
            f"request {out.request_id} ran on weight version {out.weight_version}, the committed one is {committed}"
        )
    n = len(out.output_token_ids)
    if n == 0 or len(out.exit_depths) != n or out.log_probs is None or len(out.log_probs) != n:
        raise RolloutCheckFailed(
            f"request {out.request_id}: {n} tokens but {len(out.exit_depths)} exit depths "
            f"and {None if out.log_probs is None else len(out.log_probs)} logprobs"
        )
    if out.exit_depths[0] != num_loops:
        raise RolloutCheckFailed(
            f"request {out.request_id}: exit_depths[0] is {out.exit_depths[0]}, the prefill runs T={num_loops} loops"
        )
    if any(not 1 <= d <= k for d in out.exit_depths[1:]):
        raise RolloutCheckFailed(f"request {out.request_id}: a decode depth lies outside 1..{k}")
