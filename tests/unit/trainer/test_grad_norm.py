"""The clipping norm (mcore/grad_norm.py): megatron-core's function of the gradients, taken
without a host read per parameter (docs/performance.md#train)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("megatron.core")

from megatron.core.optimizer import clip_grads  # noqa: E402
from megatron.core.utils import local_multi_tensor_l2_norm  # noqa: E402

from ouro_cli.mcore import grad_norm, megatron_on_cpu  # noqa: E402


class Reads(TorchFunctionMode):
    """Counts the calls that bring a tensor's value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in {"item", "__float__", "tolist", "__bool__", "__int__"}:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _grads(n: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3 + i, 5, generator=g) * (i + 1) for i in range(n)]


def test_the_norm_is_megatrons_without_a_read_per_tensor():
    grads = _grads()
    with megatron_on_cpu():
        reads = Reads()
        with reads:
            ours, _ = grad_norm._l2_norm(2048 * 32, None, [grads], False)
        theirs = Reads()
        with theirs:
            reference, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    assert reads.count == 0
    # the fallback it replaces reads too: its `float()` here, its per-tensor reads inside
    # torch.tensor(list of device scalars), in C++ where no mode sees them
    assert theirs.count >= 1
    assert ours.shape == (1,) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference.to(ours.device), rtol=1e-6, atol=0)
    exact = torch.cat([t.double().flatten() for t in grads]).norm()
    assert abs(float(ours) - float(exact)) <= 1e-6 * float(exact)


def test_a_nan_gradient_gives_a_nan_norm():
    grads = _grads()
    grads[3][1, 2] = float("nan")
    assert torch.isnan(grad_norm._l2_norm(2048 * 32, None, [grads], False)[0]).all()


def test_building_the_optimizer_installs_it_once(monkeypatch):
    monkeypatch.setattr(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)
    grad_norm.use_sync_free_grad_norm()
    grad_norm.use_sync_free_grad_norm()
    assert clip_grads.l2_norm_impl is grad_norm._l2_norm
    other = object()  # apex's or Transformer Engine's: left alone
    monkeypatch.setattr(clip_grads, "l2_norm_impl", other)
    grad_norm.use_sync_free_grad_norm()
    assert clip_grads.l2_norm_impl is other
