"""The shared forward on CUDA: fp32 equals CPU, bf16 tracks fp32, recompute works, loops that
gather their positions equal loops that run all of them (compiled regions on), and their row
moves make no scatter under deterministic algorithms."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.model import build, ouro, tiny_config

pytestmark = pytest.mark.gpu


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (3, 24), generator=g)
    depths = torch.randint(1, 5, (3, 24), generator=g)
    return ids, depths


def test_fp32_cuda_matches_cpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ids, depths = _inputs()
    cpu = build(tiny_config(), seed=1)
    gpu = build(tiny_config(), seed=1, device="cuda")
    ref = cpu(ids, depths=depths)
    got = gpu(ids.cuda(), depths=depths.cuda()).cpu()
    assert (got - ref).abs().max() < 1e-5


def test_bf16_cuda_tracks_fp32_and_backprops():
    ids, depths = _inputs()
    m32 = build(tiny_config(), seed=2, device="cuda")
    m16 = build(tiny_config(), seed=2, device="cuda", dtype=torch.bfloat16)
    ref = m32(ids.cuda(), depths=depths.cuda())
    out = m16(ids.cuda(), depths=depths.cuda(), recompute=True)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max()
    out.float().logsumexp(-1).sum().backward()
    assert m16.lm_head.weight.grad is not None


def test_gathered_loops_match_dense_on_cuda(monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from tests.unit.model.test_loop_work import run

    model = build(tiny_config(), seed=2, std=0.1, device="cuda")
    results = []
    for share in (0.0, 1.01):  # every loop on every position; every loop gathers
        monkeypatch.setattr(ouro, "GATHER_BELOW", share)
        results.append(run(model))
    (dense_logits, dense_grads, _, _), (logits, grads, _, _) = results
    real = torch.ones_like(logits[..., 0], dtype=torch.bool)
    real[1, :3] = real[2, 15:] = False  # the padding of test_loop_work.batch
    torch.testing.assert_close(logits[real], dense_logits[real], rtol=1e-4, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dense_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_gathered_rows_make_no_scatter_under_deterministic_cuda():
    """model/unique_rows.py compiled on CUDA under deterministic algorithms: no index_put
    (which CUDA runs as a sort and a scatter) where index_copy makes some."""
    from tests.unit.model.test_unique_rows import check_no_scatter_when_compiled

    check_no_scatter_when_compiled("cuda")
