"""On CUDA the layer's elementwise math runs compiled: the model still matches eager."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.model import build, tiny_config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_compiled_model_matches_eager(monkeypatch, dtype, tol):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (3, 24), generator=g).cuda()
    depths = torch.randint(1, 5, (3, 24), generator=g).cuda()
    model = build(tiny_config(), seed=3, device="cuda", dtype=dtype)
    compiled = model(ids, depths=depths)
    monkeypatch.setenv("OURO_COMPILE", "0")
    eager = model(ids, depths=depths)
    scale = eager.float().abs().max() if dtype == torch.bfloat16 else 1.0
    assert (compiled.float() - eager.float()).abs().max() <= tol * scale
