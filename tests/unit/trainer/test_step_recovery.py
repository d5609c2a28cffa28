"""A train step that runs out of memory runs again with smaller micro-batches
(rl/recovery.py `train_step_with_recovery`, Trainer.discard_step): the update it makes is, bit
for bit, the one a trainer cut at the lower limit from that step on makes, however far the
failed attempt got. The device is simulated (`OURO_TEST_TRAIN_LIMIT`, testing/faults.py): a
micro-batch of more than 12 positions fails after its forward, once the micro-batch before it
in the step has added its gradients, so a retry that kept them would count them twice."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from ouro_cli.model import build, tiny_config
from ouro_cli.rl import recovery
from ouro_cli.testing import faults

pytest.importorskip("megatron.core")

DEVICE = 12  # positions a micro-batch may hold on the simulated device
PLANNED = 24  # the memory plan's limit: two rows of the longest sample


@pytest.fixture(scope="module")
def base_model():
    return build(tiny_config(), seed=5)


def sample(model, g: random.Random, prompt: int, response: int):
    from ouro_cli.trainer.batching import Sample

    T, V = model.config.num_loops, model.config.vocab_size
    return Sample(
        [g.randrange(V) for _ in range(prompt)],
        [g.randrange(V) for _ in range(response)],
        [T] + [g.randint(1, T) for _ in range(response - 1)],
        [g.uniform(-6, -3) for _ in range(response)],
        g.uniform(-1.5, 1.5),
    )


@pytest.fixture(scope="module")
def batches(base_model):
    """Two mini-batches cut (micro_batch_size 2, at PLANNED tokens) as: `small`, one row of 6
    positions; `large`, that row, then two rows of 12 (24 positions: too many for the device)."""
    g = random.Random(3)
    short = [sample(base_model, g, 1, 2) for _ in range(4)]
    long = [sample(base_model, g, 5, 7) for _ in range(2)]
    return {"small": short[:2], "large": [*short[2:], *long]}


def train(model, mini_batches, retry, **options):
    """(the parameters after `train_update(mini_batches, retry=retry)`, its metrics) of a fresh CPU
    trainer whose micro-batches hold at most 2 samples and PLANNED tokens."""
    from ouro_cli.trainer import Trainer, TrainerConfig

    config = TrainerConfig(device="cpu", lr=1e-2, micro_batch_size=2, max_tokens_per_micro_batch=PLANNED, **options)
    with Trainer(copy.deepcopy(model), config) as trainer:
        before = torch.get_rng_state()
        out = trainer.train_update(mini_batches, retry=lambda step, attempt: retry(trainer, step, attempt))
        assert torch.equal(torch.get_rng_state(), before)  # no step draws a random number: a retry replays none
        return [p.detach().clone() for p in trainer.module.parameters()], out


def recovering(decisions):
    def retry(trainer, step, attempt):
        return recovery.train_step_with_recovery(
            attempt, trainer, floor=DEVICE, on_decision=lambda tokens: decisions.append((step, tokens))
        )

    return retry


def at_limits(limits):
    """A trainer that never runs out of memory, cut at `limits[step]` from each step on."""

    def retry(trainer, step, attempt):
        trainer.limit_micro_batch_tokens(limits[step])
        return attempt()

    return retry


@pytest.mark.parametrize(
    "order, correction, limits",
    [
        (("large",), "none", [DEVICE]),
        (("small", "large"), "tis", [PLANNED, DEVICE]),  # the second step retries; the first policy's logprobs stay
        (("large", "small"), "tis", [DEVICE, DEVICE]),  # the first step retries: its first-policy logprobs too
    ],
    ids=["one-step", "second-step", "first-step-is-correction"],
)
def test_a_retried_step_is_the_step_at_the_lower_limit(base_model, batches, monkeypatch, order, correction, limits):
    from ouro_cli.trainer import Trainer

    mini_batches = [batches[name] for name in order]
    decisions: list[tuple[int, int]] = []
    first_policy_at: list[int] = []  # the limit of each first-policy logprobs pass, per mini-batch
    with_first_logprobs = Trainer.with_first_logprobs
    with monkeypatch.context() as patch:
        patch.setattr(faults, "_TRAIN_LIMIT", DEVICE)
        patch.setattr(
            Trainer,
            "with_first_logprobs",
            lambda self, samples: (first_policy_at.append(self.micro_batch_tokens), with_first_logprobs(self, samples))[
                1
            ],
        )
        recovered, out = train(base_model, mini_batches, recovering(decisions), is_correction=correction)
    reference, expected = train(base_model, mini_batches, at_limits(limits), is_correction=correction)
    assert decisions == [(order.index("large"), DEVICE)]
    # the logprobs the steps used were computed at the first step's final limit, as its forward ran
    assert first_policy_at[-len(order) :] == ([limits[0]] * len(order) if correction != "none" else [])
    assert all(torch.equal(a, b) for a, b in zip(recovered, reference, strict=True))
    assert out["step_losses"] == expected["step_losses"] and out["grad_norms"] == expected["grad_norms"]
    assert out["micro_batches"] == expected["micro_batches"]  # the failed attempt's are not counted
    assert out["samples"] == sum(map(len, mini_batches))


def test_below_one_sample_the_out_of_memory_propagates(base_model, batches, monkeypatch):
    decisions: list[tuple[int, int]] = []
    monkeypatch.setattr(faults, "_TRAIN_LIMIT", DEVICE - 1)
    with pytest.raises(torch.OutOfMemoryError, match="OURO_TEST_TRAIN_LIMIT"):
        train(base_model, [batches["large"]], recovering(decisions))
    assert decisions == [(0, DEVICE)]  # halved to the floor, once; then nothing is left to give


def test_a_recorded_limit_holds_from_its_step_on():
    def train(update, step, tokens, rank=0):
        return {
            "update": update,
            "rank": rank,
            "phase": "train",
            "step": step,
            "what": "max_tokens_per_micro_batch",
            "max_tokens_per_micro_batch": tokens,
        }

    plan = {
        recovery.KEY: [
            {"update": 0, "rank": 0, "phase": "rollout", "what": "kv_blocks", "kv_blocks": 8},
            train(1, 1, 64),
            train(1, 0, 32, rank=1),
            train(2, 0, 16),
        ]
    }
    limits = {(u, s): recovery.micro_batch_limit(plan, u, s, rank=0) for u in range(4) for s in range(2)}
    assert limits == {
        (0, 0): None,
        (0, 1): None,
        (1, 0): None,
        (1, 1): 64,
        (2, 0): 16,
        (2, 1): 16,
        (3, 0): 16,
        (3, 1): 16,
    }
    assert recovery.micro_batch_limit(plan, 1, 0, rank=1) == 32
