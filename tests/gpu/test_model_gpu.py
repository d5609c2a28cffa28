"""The shared forward on CUDA: fp32 equals CPU, bf16 tracks fp32, recompute works."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.model import build, tiny_config

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
