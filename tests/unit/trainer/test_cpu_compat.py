"""The CPU compatibility layer: inert where CUDA exists, active and fully undone on CPU,
and Megatron's RNG tracker really forks and restores its (stand-in) CUDA generator."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.mcore import cpu_compat
from ouro_cli.mcore.cpu_compat import fake_cuda_rng, is_patched, megatron_on_cpu

pytest.importorskip("megatron.core")


def snapshot():
    import megatron.core.tensor_parallel.random as mrandom

    names = [
        "current_device",
        "synchronize",
        "get_rng_state",
        "set_rng_state",
        "manual_seed",
        "current_stream",
        "Stream",
        "default_generators",
        "device_count",
    ]
    state = {f"cuda.{n}": getattr(torch.cuda, n, None) for n in names}
    state |= {f"cuda.random.{n}": getattr(torch.cuda.random, n) for n in ("get_rng_state", "set_rng_state")}
    state |= {f"mrandom.{n}": getattr(mrandom, n) for n in ("_get_cuda_rng_state", "_set_cuda_rng_state")}
    state["mode"] = torch._C._len_torch_function_stack()
    return state


def assert_unpatched(before):
    after = snapshot()
    assert after.keys() == before.keys()
    for k in before:
        assert after[k] is before[k] or after[k] == before[k], k
    assert not is_patched()


def test_inert_when_cuda_is_available(monkeypatch):
    before = snapshot()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with megatron_on_cpu():
        assert_unpatched(before)
        assert torch.zeros(1).type() == "torch.FloatTensor"


def test_inert_when_disabled():
    before = snapshot()
    with megatron_on_cpu(enabled=False):
        assert_unpatched(before)
        if not torch.cuda.is_available():
            with pytest.raises((RuntimeError, AssertionError)):  # real CUDA, which this build lacks
                torch.zeros(1, device="cuda")


def test_active_then_restored_even_after_an_error():
    before = snapshot()
    with pytest.raises(KeyError), megatron_on_cpu(enabled=True):
        assert is_patched()
        assert torch.cuda.current_device() == 0
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu" and t.type() == "torch.cuda.FloatTensor" and t.cuda() is t
        with megatron_on_cpu(enabled=True):  # re-entrant: inner exit restores nothing
            pass
        assert is_patched() and torch.cuda.current_device() == 0
        raise KeyError("boom")
    assert_unpatched(before)


def test_megatron_rng_tracker_forks_the_stand_in_generator():
    from megatron.core import tensor_parallel

    with megatron_on_cpu(enabled=True):
        tracker = tensor_parallel.get_cuda_rng_tracker()
        previous = tracker.get_states()
        tracker.reset()
        tracker.add(tensor_parallel.random._MODEL_PARALLEL_RNG_TRACKER_NAME, 77)
        saved = {k: v.clone() for k, v in tracker.get_states().items()}
        outside = fake_cuda_rng().get_state()
        with tracker.fork():
            first = torch.empty(4).normal_(generator=fake_cuda_rng())
        assert torch.equal(fake_cuda_rng().get_state(), outside)  # fork restored the default state
        with tracker.fork():
            second = torch.empty(4).normal_(generator=fake_cuda_rng())
        assert not torch.equal(first, second)  # the tracked stream advanced
        tracker.set_states(saved)
        with tracker.fork():
            again = torch.empty(4).normal_(generator=fake_cuda_rng())
        assert torch.equal(first, again)
        tracker.reset()
        tracker.set_states(previous)
    assert cpu_compat._depth == 0
