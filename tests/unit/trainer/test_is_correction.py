"""The mismatch correction (ouro_cli/trainer/is_correction.py, --is-correction) on hand-computed
cases, its gradient, and the trainer's statistics: the weights and masks it applied and the
mismatch by exit depth."""

from __future__ import annotations

import math

import pytest
import torch
from _trainer_samples import forward_backward_on_cpu, make_samples

from ouro_cli.errors import UserError
from ouro_cli.model import build, tiny_config
from ouro_cli.trainer.config import TrainerConfig
from ouro_cli.trainer.is_correction import correct
from ouro_cli.trainer.loss import clipped_surrogate

LOG = math.log
BOUNDS = (0.5, 2.0)


def _case(ratios, samples):
    """Trainer logprobs whose ratio to a rollout of -1 is each of `ratios`."""
    rollout = torch.full((len(ratios),), -1.0, dtype=torch.float64)
    new = rollout + torch.tensor([LOG(r) for r in ratios], dtype=torch.float64)
    return new, rollout, torch.tensor(samples)


def test_none_is_the_uncorrected_objective():
    new, rollout, ids = _case([1.0, 3.0], [0, 0])
    c = correct("none", BOUNDS, new, rollout, ids)
    assert c.weight.tolist() == [1.0, 1.0] and c.reference is rollout and not c.masked.any()


def test_tis_weighs_by_the_ratio_truncated_at_high():
    new, rollout, ids = _case([1.0, 3.0, 0.25, 2.0], [0, 0, 1, 1])
    c = correct("tis", BOUNDS, new, rollout, ids)
    assert torch.allclose(c.weight, torch.tensor([1.0, 2.0, 0.25, 2.0], dtype=torch.float64))
    assert torch.equal(c.reference, new)  # the PPO ratio against the trainer's own logprobs


def test_a_later_step_is_corrected_by_the_first_policy():
    """After a step the trainer's logprobs `new` have moved: the weight still compares the first
    policy with the rollout, and the ratio is taken against the first policy."""
    first, rollout, ids = _case([1.0, 3.0, 0.25], [0, 0, 1])
    new = first + 0.5
    c = correct("tis", BOUNDS, new, rollout, ids, first=first)
    assert torch.allclose(c.weight, torch.tensor([1.0, 2.0, 0.25], dtype=torch.float64))
    assert c.reference is first
    assert correct("mis", BOUNDS, new, rollout, ids, first=first).weight.tolist() == [1.0, 0.0, 0.0]


def test_mis_masks_tokens_outside_the_band():
    new, rollout, ids = _case([1.0, 3.0, 0.25, 0.51, 1.99, 2.01], [0, 0, 0, 1, 1, 1])
    c = correct("mis", BOUNDS, new, rollout, ids)
    assert c.weight.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert c.masked.tolist() == [False, True, True, False, False, True]


def test_geo_mask_masks_whole_sequences_by_their_geometric_mean():
    # sample 0: ratios 4 and 1/4 (geometric mean 1, kept although each token is outside);
    # sample 1: 3 and 3 (mean 3, masked); sample 2: 0.8 alone (kept); sample 3: 0.27, 1 (mean 0.52: kept,
    # then masked by a band from 0.6)
    new, rollout, ids = _case([4.0, 0.25, 3.0, 3.0, 0.8, 0.27, 1.0], [0, 0, 1, 1, 2, 3, 3])
    c = correct("geo-mask", BOUNDS, new, rollout, ids)
    assert c.weight.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    c = correct("geo-mask", (0.6, 2.0), new, rollout, ids)
    assert c.weight.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_corrected_gradient_is_the_weighted_policy_gradient():
    """With a correction the surrogate's ratio is 1 in value, so per token d loss / d new = -w · A
    (no clipping at r = 1); the weight carries no gradient."""
    new, rollout, ids = _case([1.0, 3.0, 0.25], [0, 1, 2])
    new.requires_grad_(True)
    advantages = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    c = correct("tis", BOUNDS, new, rollout, ids)
    terms = clipped_surrogate(new, c.reference, advantages, 0.2, 0.28)
    assert torch.allclose(terms.ratio, torch.ones(3, dtype=torch.float64)) and not terms.clipped.any()
    (terms.loss * c.weight).sum().backward()
    assert torch.allclose(new.grad, -c.weight * advantages)


def test_options_are_checked():
    for bounds in ([0.5], [1.5, 2.0], [0.5, 0.9], [0.5, 2.0, 3.0]):
        with pytest.raises(UserError, match="--is-bounds takes LOW HIGH"):
            TrainerConfig(is_bounds=bounds)
    with pytest.raises(UserError, match="--is-correction must be none, tis, mis or geo-mask"):
        TrainerConfig(is_correction="icepop")
    assert TrainerConfig().is_correction == "none" and TrainerConfig().is_bounds == [0.5, 2.0]


def test_is_bounds_takes_two_numbers_after_one_flag():
    from ouro_cli.cli.common import expand_multi_value_options

    assert expand_multi_value_options(["train", "--is-bounds", "0.5", "2", "--depths", "2", "3"]) == [
        "train",
        "--is-bounds",
        "0.5",
        "--is-bounds",
        "2",
        "--depths",
        "2",
        "--depths",
        "3",
    ]


@pytest.fixture(scope="module")
def base_model():
    return build(tiny_config(), seed=3)


def _forward_backward(model, samples, **options):
    pytest.importorskip("megatron.core")
    return forward_backward_on_cpu(model, samples, **options)


def test_trainer_reports_what_the_correction_did_and_the_mismatch_by_depth(base_model):
    samples = make_samples(base_model, 6, seed=11, noise=1.0)
    plain, plain_grads = _forward_backward(base_model, samples)
    assert (plain["is_weight_mean"], plain["is_weight_max"], plain["is_masked_fraction"]) == (1.0, 1.0, 0.0)
    by_mean, by_max = plain["logprob_mismatch_mean_by_depth"], plain["logprob_mismatch_max_by_depth"]
    assert set(by_mean) == set(by_max) and "4" in by_mean and len(by_mean) >= 2
    assert max(by_max.values()) == plain["logprob_mismatch_max"]
    counts = {}  # the scored tokens' depths, from the samples themselves
    for s in samples:
        for d in [4] + list(s.exit_depths[1:]):
            counts[str(d)] = counts.get(str(d), 0) + 1
    assert set(counts) == set(by_mean)
    total = sum(by_mean[d] * counts[d] for d in counts) / sum(counts.values())
    assert total == pytest.approx(plain["logprob_mismatch_mean"], rel=1e-6)

    mis, mis_grads = _forward_backward(base_model, samples, is_correction="mis", is_bounds=[0.7, 1.4])
    assert 0 < mis["is_masked_fraction"] < 1 and mis["is_weight_max"] == 1.0
    assert mis["is_weight_mean"] == pytest.approx(1 - mis["is_masked_fraction"])
    tis, _ = _forward_backward(base_model, samples, is_correction="tis", is_bounds=[0.5, 1.5])
    assert tis["is_masked_fraction"] == 0.0 and tis["is_weight_max"] <= 1.5 and tis["ratio_mean"] == 1.0
    geo, _ = _forward_backward(base_model, samples, is_correction="geo-mask", is_bounds=[0.9, 1.1])
    assert geo["is_masked_fraction"] > 0
    assert any(not torch.allclose(mis_grads[k], plain_grads[k]) for k in plain_grads)
