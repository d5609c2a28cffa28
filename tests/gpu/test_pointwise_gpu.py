"""On CUDA the layer's elementwise math runs compiled, by default each layer call as one region
(`compile_layers="off"`: one compiled call per function): the model still matches eager."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.model import build, tiny_config
from ouro_cli.settings import ExecutionSettings

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layers", ["auto", "off"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_compiled_model_matches_eager(dtype, tol, layers):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (3, 24), generator=g).cuda()
    depths = torch.randint(1, 5, (3, 24), generator=g).cuda()
    model = build(tiny_config(), seed=3, device="cuda", dtype=dtype)
    model.execution = ExecutionSettings(compile_layers=layers)
    compiled = model(ids, depths=depths)
    model.execution = ExecutionSettings(compile="off")
    eager = model(ids, depths=depths)
    scale = eager.float().abs().max() if dtype == torch.bfloat16 else 1.0
    assert (compiled.float() - eager.float()).abs().max() <= tol * scale


def test_compiled_layers_match_eager_on_cuda():
    """Layer regions on CUDA (fp32, packed documents, mixed depths, recompute): the
    logits and gradients of the per-layer compiled regions are eager's to fp32 rounding."""
    from tests.unit.model.test_compiled_layers import run

    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(tiny_config(), seed=3, device="cuda", dtype=torch.float32)
    model.execution = ExecutionSettings(compile="off")
    eager_logits, eager_grads = run(model, recompute=True)
    model.execution = ExecutionSettings(compile="auto", compile_layers="on")
    logits, grads = run(model, recompute=True)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_later_micro_batches_compile_nothing_on_cuda():
    """After a first micro-batch, micro-batches of other sizes compile nothing, on both sides of
    the size thresholds (4,096 rows, 5 Mi elements) by which inductor's mix-order reduction
    (an RMSNorm backward's two sums in one kernel) chooses in its strict mode: there they were
    guards, and a steady update of the 1.4B e2e shape compiled again (docs/performance.md#train).
    Its widths also cross between multiples of 8 and others (512, then 700), where SDPA's
    attention-bias alignment is still a guard: on the H200 this test failed there (13 s of
    compiling, docs/performance.md#train), and it will until that variant is gone.
    Every micro-batch is padded and has mixed depths, so each meets the same argument kinds:
    a dense first loop, then loops that gather their running positions."""
    from ouro_cli.model import compiling

    torch._dynamo.reset()
    compiling.compiled.cache_clear()
    model = build(tiny_config(), seed=0, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    spent = []
    for rows, length in ((2, 512), (3, 700), (64, 2048), (40, 1500)):  # 1,024 ... 131,072 positions
        ids = torch.randint(3, 100, (rows, length), generator=g)
        depths = torch.randint(1, 5, (rows, length), generator=g)
        depths[:, :3] = 4
        valid = torch.ones(rows, length, dtype=torch.long)
        valid[0, -(length // 8) :] = 0
        before = compiling.compile_seconds()
        model(ids.cuda(), depths.cuda(), attention_mask=valid.cuda()).float().square().mean().backward()
        torch.cuda.synchronize()
        spent.append(compiling.compile_seconds() - before)
    assert spent[0] > 0 and spent[1:] == [0.0] * 3, spent
