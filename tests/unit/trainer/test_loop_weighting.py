"""Loop weighting (docs/grpo.md): the weights ω_t against hand computations, the surrogate's
value staying the exit loop's, and the trainer's gradient against an independent computation
of −Σ_tok w · A · r · 1[unclipped] · Σ_t ω_t ∇ log π^(t), with π^(t) read from plain forwards
at depths min(d, t) (loop t's state of a token does not depend on any loop above t)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _trainer_samples import forward_backward_on_cpu, make_samples

from ouro_cli.model import build, tiny_config
from ouro_cli.trainer.loss import clipped_surrogate, loop_weights, weighted_score


def test_uniform_and_progressive_weights_by_hand():
    depths = torch.tensor([1, 2, 4])
    uniform = loop_weights(depths, 4, "uniform")
    assert uniform.tolist() == [[1, 0, 0, 0], [0.5, 0.5, 0, 0], [0.25] * 4]
    progressive = loop_weights(depths, 4, "progressive", alpha=2.0)
    expected = [[1, 0, 0, 0], [1 / 5, 4 / 5, 0, 0], [1 / 30, 4 / 30, 9 / 30, 16 / 30]]
    torch.testing.assert_close(progressive, torch.tensor(expected), rtol=0, atol=1e-7)
    # alpha = 0 is uniform; the exit weighting is one-hot at the exit loop
    torch.testing.assert_close(loop_weights(depths, 4, "progressive", alpha=0.0), uniform)
    assert loop_weights(depths, 4, "exit").tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1]]


def test_exit_pdf_weights_by_hand():
    lam = torch.tensor([[0.5, 0.5, 0.5, 0.9], [0.2, 0.5, 0.1, 0.7], [0.2, 0.5, 0.1, 0.7], [0.0, 0.3, 0.3, 0.3]])
    w = loop_weights(torch.tensor([4, 2, 3, 1]), 4, "exit-pdf", lambdas=lam, num_loops=4)
    # T = 4: p = (λ1, λ2(1−λ1), λ3(1−λ1)(1−λ2), (1−λ1)(1−λ2)(1−λ3)); λ4 never counts
    p0 = [0.5, 0.25, 0.125, 0.125]
    p1 = [0.2, 0.5 * 0.8]  # d = 2: renormalised over loops 1, 2
    p2 = [0.2, 0.4, 0.1 * 0.8 * 0.5]
    expected = [p0, [p1[0] / sum(p1), p1[1] / sum(p1), 0, 0], [x / sum(p2) for x in p2] + [0], [1, 0, 0, 0]]
    # the last token: d = 1 with λ1 = 0 has p_1 = 0 on its only loop; it keeps the exit loop
    torch.testing.assert_close(w, torch.tensor(expected), rtol=0, atol=1e-7)
    assert not w.requires_grad


def test_the_weighted_score_keeps_the_exit_value_and_takes_the_weighted_gradient():
    exit_lp = torch.tensor([-1.3, -0.7], requires_grad=True)
    loops = torch.tensor([[-2.0, -1.5, 0.0], [-0.9, -0.8, -0.7]], requires_grad=True)
    omega = torch.tensor([[0.25, 0.75, 0.0], [0.2, 0.3, 0.5]])
    score = weighted_score(exit_lp, loops, omega)
    assert torch.equal(score.detach(), exit_lp.detach())  # bit for bit: the ratio is the exit loop's
    score.sum().backward()
    assert exit_lp.grad is None or torch.equal(exit_lp.grad, torch.zeros(2))
    assert torch.equal(loops.grad, omega)
    # through the surrogate, a clipped token contributes no gradient at all
    old = torch.tensor([-1.3, -0.7 - 1.0])  # ratio 1 and e ≈ 2.72 (clipped above for A > 0)
    loops.grad = None
    terms = clipped_surrogate(weighted_score(exit_lp, loops, omega), old, torch.tensor([1.0, 1.0]), 0.2, 0.28)
    terms.loss.sum().backward()
    assert terms.clipped.tolist() == [False, True]
    torch.testing.assert_close(loops.grad, torch.stack([-omega[0], torch.zeros(3)]))


pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def base_model():
    model = build(tiny_config(), seed=5)
    with torch.no_grad():  # a gate that does not sit at 0.5 everywhere
        model.model.early_exit_gate.weight.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def samples(base_model):
    return make_samples(base_model, 5, seed=4, temperature=0.9, noise=0.3)


def per_loop_reference(model, s):
    """[n, T] log π^(t) of each response token (t > its depth: the exit loop's; `ran` marks t ≤ d), gate λ_t,
    from one plain forward per t at depths min(d, t)."""
    T = model.config.num_loops
    m, n = len(s.prompt_ids), len(s.response_ids)
    ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
    depths = torch.tensor([[T] * m + list(s.exit_depths[1:]) + [T]])
    scored_depth = [T] + list(s.exit_depths[1:])
    lam = torch.zeros(n, T, dtype=torch.float64)
    columns = []
    for t in range(1, T + 1):
        last = {}
        logits = model(ids, depths.clamp(max=t), state_sink=lambda loop, h, last=last: last.update(h=h))[0]
        with torch.no_grad():
            lam[:, t - 1] = torch.sigmoid(model.model.early_exit_gate(last["h"][0, m - 1 : m + n - 1]).double())[:, 0]
        column = []
        for j in range(n):
            row = logits[m - 1 + j].double() / s.temperature
            column.append(row[s.response_ids[j]] - torch.logsumexp(row, 0))
        columns.append(torch.stack(column))
    lp = torch.stack(columns, -1)
    ran = torch.tensor([[t <= d for t in range(1, T + 1)] for d in scored_depth])
    return lp, ran, lam, scored_depth


def reference_weights(scheme, ran, lam, alpha, T):
    rows = []
    for r, gate in zip(ran.tolist(), lam.tolist(), strict=True):
        d = sum(r)
        if scheme == "uniform":
            raw = [1.0] * d
        elif scheme == "progressive":
            raw = [t**alpha for t in range(1, d + 1)]
        else:
            raw, survive = [], 1.0
            for t in range(1, d + 1):
                raw.append(survive if t == T else gate[t - 1] * survive)
                survive *= 1 - gate[t - 1]
        rows.append([x / sum(raw) for x in raw] + [0.0] * (T - d))
    return torch.tensor(rows, dtype=torch.float64)


def reference(model, samples, scheme, alpha=1.0, eps_low=0.2, eps_high=0.28):
    model = copy.deepcopy(model)
    model.zero_grad()
    T = model.config.num_loops
    total_tokens = sum(len(s.response_ids) for s in samples)
    loss_value, objective = 0.0, torch.zeros((), dtype=torch.float64)
    for s in samples:
        lp, ran, lam, scored_depth = per_loop_reference(model, s)
        omega = reference_weights(scheme, ran, lam, alpha, T)
        for j, d in enumerate(scored_depth):
            new = lp[j, d - 1]
            ratio = math.exp(float(new.detach()) - s.rollout_logprobs[j])
            a = s.advantage
            loss_value += -min(ratio * a, min(max(ratio, 1 - eps_low), 1 + eps_high) * a) / total_tokens
            unclipped = not ((a > 0 and ratio > 1 + eps_high) or (a < 0 and ratio < 1 - eps_low))
            if unclipped:
                score = sum(omega[j, t] * lp[j, t] for t in range(d))
                objective = objective - a * ratio * score / total_tokens
    objective.backward()
    grads = {
        name: p.grad.detach().float().clone()
        for name, p in model.named_parameters()
        if not name.startswith("model.early_exit_gate")
    }
    return loss_value, grads


def trainer_run(model, samples, **options):
    return forward_backward_on_cpu(model, samples, **options)


@pytest.mark.parametrize("scheme, alpha", [("uniform", 1.0), ("progressive", 1.5), ("exit-pdf", 1.0)])
def test_loop_weighted_gradient_equals_the_reference(base_model, samples, scheme, alpha):
    metrics, grads = trainer_run(
        base_model, samples, loop_weighting=scheme, loop_weight_alpha=alpha, micro_batch_size=3, pack_length=16
    )
    ref_loss, ref_grads = reference(base_model, samples, scheme, alpha)
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-6)  # the loss value is the exit loop's
    assert 0 < metrics["clip_fraction"] < 1
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    exit_metrics, exit_grads = trainer_run(base_model, samples, micro_batch_size=3, pack_length=16)
    assert exit_metrics["loss"] == metrics["loss"]  # same ratios, same value, other gradient
    assert any(not torch.allclose(exit_grads[k], grads[k]) for k in grads)


def test_per_loop_logprobs_are_reported_and_exit_weighting_adds_no_work(base_model, samples):
    from ouro_cli.trainer import Trainer, TrainerConfig

    T = base_model.config.num_loops
    metrics, _ = trainer_run(base_model, samples, loop_weighting="uniform")
    expected_sum, expected_count = [0.0] * T, [0] * T
    for s in samples:
        lp, ran, _, _ = per_loop_reference(base_model, s)
        for t in range(T):
            expected_sum[t] += float(lp[:, t][ran[:, t]].sum())
            expected_count[t] += int(ran[:, t].sum())
    assert metrics["loop_tokens"] == expected_count
    assert metrics["loop_logprob_mean"] == pytest.approx(
        [a / n for a, n in zip(expected_sum, expected_count, strict=True)], abs=1e-5
    )
    # loop weighting "exit": the replay gets no state sink and no per-loop figure is reported
    trainer = Trainer(copy.deepcopy(base_model), TrainerConfig(device="cpu"))
    seen = []
    forward = trainer.module.ouro.forward
    trainer.module.ouro.forward = lambda *a, **k: seen.append(k) or forward(*a, **k)
    try:
        plain = trainer.forward_backward(samples)
    finally:
        trainer.close()
    assert seen and all("state_sink" not in k for k in seen)
    assert "loop_logprob_mean" not in plain
