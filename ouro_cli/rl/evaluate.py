"""Held-out evaluation: accuracy per decode budget K, with mean exit depth and tokens.

One sample per prompt at the given temperature, with seeds derived from the run seed
and the prompt's position only, so two evaluations of different policies on the same
prompts are paired (the difference is the policy, not the dice).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .data import Row
from .rollout import generate_groups


def evaluate(engine, rows: Sequence[Row], prompt_ids: Sequence[list[int]], *, ks: Sequence[int], num_loops: int,
             reward_fn: Callable[[str, Any, Any], float], seed: int, temperature: float, max_tokens: int,
             exit_threshold: float, min_loops: int, stop_token_ids: Sequence[int],
             decode: Callable[[list[int]], str], speculative_tokens: int = 0,
             async_scheduling: bool = False) -> list[dict[str, Any]]:
    results = []
    for k in ks:
        samples = generate_groups(engine, rows, prompt_ids, group_size=1, k=k, num_loops=num_loops, seed=seed,
                                  update=0, temperature=temperature, max_tokens=max_tokens,
                                  exit_threshold=exit_threshold, min_loops=min_loops, stop_token_ids=stop_token_ids,
                                  decode=decode, purpose="eval", speculative_tokens=speculative_tokens,
                                  async_scheduling=async_scheduling)
        rewards = [float(reward_fn(s.text, s.row.label, s.row.metadata)) for s in samples]
        decode_depths = [d for s in samples for d in s.exit_depths[1:]]
        results.append({
            "k": k,
            "prompts": len(samples),
            "accuracy": sum(rewards) / len(rewards),
            "mean_exit_depth": sum(decode_depths) / len(decode_depths) if decode_depths else float(num_loops),
            "mean_tokens": sum(len(s.response_ids) for s in samples) / len(samples),
            "truncated": sum(s.finish_reason == "length" for s in samples),
        })
    return results
