"""Each loop runs the layer stack only on the positions whose depth reaches it (model/ouro.py
`GATHER_BELOW`): the logits, the gradients of every parameter, the KV planes and the exit
states equal those of the replay that runs every loop on every position and discards what
a position does not need (`GATHER_BELOW = 0`), to fp32 rounding, with mixed depths, packed
documents, padding on either side and recompute; in fp64 they equal the per-token
reference; and `positions_per_loop`, the trainer's count of executed work, is what the
forward runs."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.model import build, ouro, tiny_config
from ouro_cli.model.layers import DecoderLayer

from .reference import reference_logits

T = 4
ALWAYS = 1.01  # gather every loop that not every position runs
DENSE = 0.0  # never gather: the replay before gathering


@pytest.fixture
def gather_below(monkeypatch):
    return lambda share: monkeypatch.setattr(ouro, "GATHER_BELOW", share)


def batch():
    """Three rows of 20: two packed documents, a left-padded row, three documents and right padding."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 100, (3, 20), generator=g)
    depths = torch.randint(1, T + 1, (3, 20), generator=g)
    depths[:, :4] = T  # a prompt at full depth
    valid = torch.ones(3, 20, dtype=torch.long)
    valid[1, :3] = 0
    valid[2, 15:] = 0
    docs = torch.tensor([[0] * 8 + [1] * 12, [0] * 20, [0] * 5 + [1] * 7 + [2] * 8])
    return ids, depths, valid, docs


def run(model, recompute=False):
    """Logits, parameter gradients, exit states and KV planes of one forward/backward over
    `batch()` (tests/gpu reuses it on CUDA)."""
    device = next(model.parameters()).device
    ids, depths, valid, docs = (x.to(device) for x in batch())
    model.zero_grad(set_to_none=True)
    states, planes = {}, {}
    logits = model(
        ids,
        depths,
        attention_mask=valid,
        document_ids=docs,
        recompute=recompute,
        state_sink=lambda t, h: states.__setitem__(t, h.detach()),
        kv_sink=lambda t, i, k, v: planes.__setitem__((t, i), (k.detach(), v.detach())),
    )
    weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).to(device)
    (logits * weight * valid[..., None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, states, planes


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_gathered_loops_equal_the_dense_replay(gather_below, recompute):
    model = build(tiny_config(), dtype=torch.float32, seed=2, std=0.1)
    model.model.early_exit_gate.requires_grad_(False)
    ids, depths, valid, docs = batch()
    real = valid.bool()
    default = ouro.GATHER_BELOW
    gather_below(DENSE)
    want_logits, want_grads, want_states, want_planes = run(model, recompute)
    for share in (default, ALWAYS):
        gather_below(share)
        assert sum(ouro.positions_per_loop(depths, valid)) < T * depths.numel()  # it does gather
        logits, grads, states, planes = run(model, recompute)
        torch.testing.assert_close(logits[real], want_logits[real], rtol=1e-5, atol=1e-6)
        assert (
            grads.keys()
            == want_grads.keys()
            == {n for n, _ in model.named_parameters()} - {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}
        )
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-6, msg=name)
        assert planes.keys() == want_planes.keys()
        for key, (k, v) in planes.items():
            torch.testing.assert_close(k[real], want_planes[key][0][real], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v[real], want_planes[key][1][real], rtol=1e-5, atol=1e-6)
        assert states.keys() == want_states.keys() == set(range(1, T + 1))
        for t, h in states.items():
            torch.testing.assert_close(h[real], want_states[t][real], rtol=1e-5, atol=1e-6)
        for t in range(2, T + 1):  # a position past its depth holds the exit state of its own last loop
            h, done = states[t], real & (depths < t)
            last = torch.stack(
                [states[int(d)][b, i] for b, i, d in zip(*done.nonzero(as_tuple=True), depths[done], strict=True)]
            )
            assert torch.equal(h[done], last)


def test_gathered_fp64_equals_the_per_token_reference(gather_below):
    cfg = tiny_config(vocab_size=48, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)
    model = build(cfg, dtype=torch.float64, seed=3, std=0.2)
    gather_below(ALWAYS)
    ids, depths, valid, docs = batch()
    ids = ids % cfg.vocab_size
    logits = model(ids, depths, attention_mask=valid, document_ids=docs)
    for row in range(3):
        for doc in docs[row].unique().tolist():
            cols = ((docs[row] == doc) & valid[row].bool()).nonzero().squeeze(1)
            want = reference_logits(model.state_dict(), cfg, ids[row, cols].tolist(), depths[row, cols].tolist())
            assert torch.allclose(logits[row, cols], want, atol=1e-10, rtol=0), (row, doc)


@pytest.mark.parametrize("share", [DENSE, "default", ALWAYS])
def test_positions_per_loop_is_what_the_forward_runs(gather_below, monkeypatch, share):
    if share != "default":
        gather_below(share)
    ran: list[int] = []
    layer_forward = DecoderLayer.forward

    def counting(self, h, *args, **kwargs):
        ran.append(h.shape[0] * h.shape[1])
        return layer_forward(self, h, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", counting)
    model = build(tiny_config(), seed=0)
    ids, depths, valid, docs = batch()
    for mask in (valid, None):
        ran.clear()
        with torch.no_grad():
            model(ids, depths, attention_mask=mask, document_ids=docs)
        per_loop = ouro.positions_per_loop(depths, mask)
        assert sum(ran) == len(model.model.layers) * sum(per_loop)
        assert len(per_loop) == T
        if share == DENSE:
            assert per_loop == [depths.numel()] * T


def test_a_loop_gathers_only_below_the_share(gather_below):
    """Loop 1 of an unpadded batch runs everything; a loop that most positions run runs on all
    of them (their results discarded); one below the share runs only its own positions."""
    gather_below(0.5)
    depths = torch.tensor([[4] * 6 + [3] * 2 + [2] * 2 + [1] * 10])  # loops 2..4: 10, 8, 6 of 20 run
    assert ouro.positions_per_loop(depths) == [20, 20, 8, 6]
    padded = torch.tensor([[1] * 12 + [0] * 8])  # loop 1: 12 of 20 positions are real
    assert ouro.positions_per_loop(depths, padded) == [20, 20, 8, 6]
    assert ouro.positions_per_loop(depths, torch.tensor([[1] * 9 + [0] * 11])) == [9, 9, 8, 6]


def test_exact_mode_gathers_only_where_its_attention_is_the_decode_kernel(gather_below, monkeypatch):
    """Exact mode on CPU (its torch attention, which has no gathered form) runs every loop on
    every position, even below the share; on CUDA, or under the Triton interpreter, where its
    attention is the decode kernel, it gathers as the default mode does (the interpreter check
    of the engine against both replays: tests/unit/engine/_fixed_tile_checks.py)."""
    from ouro_cli.settings import ExecutionSettings, executing

    gather_below(0.5)
    exact, default = ExecutionSettings(exact=True), ExecutionSettings()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ouro.gathering_allowed(default, "cpu") and ouro.gathering_allowed(default, "cuda")
    assert not ouro.gathering_allowed(exact, "cpu") and ouro.gathering_allowed(exact, "cuda")
    depths = torch.tensor([[4] * 6 + [3] * 2 + [2] * 2 + [1] * 10])
    with executing(exact):
        assert ouro.positions_per_loop(depths) == [20] * 4
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ouro.gathering_allowed(exact, "cpu")
    with executing(exact):
        assert ouro.positions_per_loop(depths) == [20, 20, 8, 6]


def test_a_gathered_loop_hands_its_step_the_same_kinds_of_argument(gather_below, monkeypatch):
    """A compiled region guards on whether each argument is a view and whether it is None, and
    compiles a variant per answer. So the gathered loop's layer step gets tensors of their own
    (not views) at layer 0 as at the layers after it, and, with SDPA, no layout mask whether the
    micro-batch is padded or not (only the paged replay attention reads it)."""
    gather_below(ALWAYS)
    seen = []
    step = ouro._layer_step_at_rows

    def spy(layer, closing, x, normed, cos, sin, rows, slots, mask, layout_mask, *rest):
        seen.append(([t._base is None for t in (x, normed, cos, sin)], layout_mask))
        return step(layer, closing, x, normed, cos, sin, rows, slots, mask, layout_mask, *rest)

    monkeypatch.setattr(ouro, "_layer_step_at_rows", spy)
    model = build(tiny_config(), seed=0)
    ids, depths, valid, docs = batch()
    with torch.no_grad():
        for mask in (valid, None):
            model(ids, depths, attention_mask=mask, document_ids=docs)
    assert len(seen) >= 2 * len(model.model.layers)
    assert all(owned == [True] * 4 and layout_mask is None for owned, layout_mask in seen), seen


def test_a_gathered_first_loop_keeps_padding_kv_that_requires_grad(gather_below, monkeypatch):
    """Where padding makes loop 1 gather, the padding keeps zeros as its K/V, and in a backward
    pass they require grad as the K/V of every later loop do: a compiled region guards on
    `requires_grad`, and a padded micro-batch compiled a variant of its own in a steady update
    (docs/performance.md#train). Without grad, nothing requires it. K and V are two tensors, as
    a later loop's are: the region also guards on its arguments' aliasing."""
    gather_below(ALWAYS)
    seen = []
    step = ouro._layer_step_at_rows

    def spy(*args):
        seen.append((torch.is_grad_enabled(), args[-2].requires_grad, args[-1].requires_grad))
        assert args[-2] is not args[-1]
        return step(*args)

    monkeypatch.setattr(ouro, "_layer_step_at_rows", spy)
    model = build(tiny_config(), seed=0)
    ids, depths, valid, docs = batch()
    model(ids, depths, attention_mask=valid, document_ids=docs).float().square().mean().backward()
    with torch.no_grad():
        model(ids, depths, attention_mask=valid, document_ids=docs)
    per_pass = T * len(model.model.layers)  # every loop gathers, loop 1 too (padding)
    assert len(seen) == 2 * per_pass
    assert seen == [(True, True, True)] * per_pass + [(False, False, False)] * per_pass, seen
