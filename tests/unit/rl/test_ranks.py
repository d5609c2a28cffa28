"""Data-parallel ranks in the update loop, without a process group.

- Rollout seeds depend on a sample's global batch position only: the samples a rank
  draws for prompts at positions 1 and 3 carry the seeds one rank gives them, and a
  single-rank run keeps the seeds it had before ranks stopped being part of the seed
  (pinned values).
- The per-rank parameter hash sees every bit, and disagreeing hashes stop the run
  naming the update.
- The memory plan is sized from the least memory any rank measured, so every rank's plan
  is the same.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ouro_cli.engine import SamplingParams
from ouro_cli.errors import CheckFailed
from ouro_cli.rl.data import Row
from ouro_cli.rl.digest import params_sha256
from ouro_cli.rl.loop import check_rank_params
from ouro_cli.rl.rollout import RolloutSampling, generate_groups, request_seed

T = 4


def test_single_rank_seeds_are_unchanged():
    # values of the earlier request_seed(seed, update, rank=0, index)
    assert request_seed(1234, 3, 5) == 2689283487686329366
    assert request_seed(1234, 0, 7, "eval") == 549682632383915728


class EchoEngine:
    """Answers every request with two tokens and keeps the sampling parameters it got."""

    def __init__(self) -> None:
        self.seen: list[SamplingParams] = []

    def get_weight_version(self) -> int:
        return 1

    def generate(self, prompts, params):
        self.seen.extend(params)
        return [
            SimpleNamespace(
                request_id=str(i),
                output_token_ids=[7, 8],
                exit_depths=[T, p.max_loops],
                log_probs=[-0.5, -0.25],
                finish_reason="length",
                weight_version=1,
                sampling_params=p,
            )
            for i, p in enumerate(params)
        ]


def _groups(rows, positions=None):
    engine = EchoEngine()
    sampling = RolloutSampling(
        num_loops=T,
        seed=1234,
        temperature=1.0,
        max_tokens=2,
        exit_threshold=1.0,
        min_loops=1,
        stop_token_ids=(0,),
        decode=lambda ids: "",
    )
    samples = generate_groups(
        engine, rows, [[1, 2]] * len(rows), sampling, group_size=2, k=2, update=3, positions=positions
    )
    return [(s.row.problem_id, s.group, s.seed) for s in samples]


def test_a_rank_samples_its_share_of_the_global_batch_with_the_global_seeds():
    rows = [Row(index=i, line=i + 1, prompt=f"q{i}", label=i, problem_id=f"p{i}") for i in range(4)]
    one_rank = _groups(rows)
    rank0 = _groups(rows[0::2], positions=[0, 2])
    rank1 = _groups(rows[1::2], positions=[1, 3])
    assert sorted(rank0 + rank1, key=lambda x: x[1]) == one_rank  # stable: members keep their order
    assert [seed for _, _, seed in one_rank] == [request_seed(1234, 3, i) for i in range(8)]
    with pytest.raises(ValueError, match="positions"):
        _groups(rows, positions=[0])


def _trainer(tensors: dict[str, torch.Tensor]):
    return SimpleNamespace(named_weights_for_publication=lambda: iter(tensors.items()))


def test_parameter_hash_sees_every_bit_name_and_dtype():
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5, dtype=torch.float64)}
    base = params_sha256(_trainer(tensors))
    assert params_sha256(_trainer({k: v.clone() for k, v in tensors.items()})) == base
    flipped = tensors["a"].clone()
    flipped.view(torch.int32)[2, 3] ^= 1  # the lowest mantissa bit of one element
    assert params_sha256(_trainer({**tensors, "a": flipped})) != base
    assert params_sha256(_trainer({"a2": tensors["a"], "b": tensors["b"]})) != base
    assert params_sha256(_trainer({**tensors, "b": tensors["b"].float()})) != base


def test_ranks_that_disagree_stop_the_run_naming_the_update():
    assert check_rank_params(4, ["ab" * 32, "ab" * 32]) is True
    with pytest.raises(CheckFailed, match=r"update 7: trainer parameters differ .*rank 1 cdcdcdcdcdcd"):
        check_rank_params(7, ["ab" * 32, "cd" * 32])


def test_every_rank_sizes_from_the_least_memory_any_rank_measured(monkeypatch):
    from ouro_cli.rl import loop
    from ouro_cli.rl.sizing import DeviceMemory

    measured = [DeviceMemory("cpu", 64, 40), DeviceMemory("cpu", 64, 39)]  # free memory moved between two reads
    monkeypatch.setattr(loop, "_all_gather", lambda value: measured)
    assert loop._agreed(measured[0]) == loop._agreed(measured[1]) == DeviceMemory("cpu", 64, 39)
    monkeypatch.undo()
    assert loop._agreed(measured[0]) == measured[0]  # one process: its own figures
