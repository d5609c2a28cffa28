"""rl/allocator.py: the allocator settings a colocated run asks for, the cap it sets from the
plan's budget, and the graph-pool figure read from the allocator's snapshot (CUDA calls
replaced, so the arithmetic runs on CPU; on a GPU every `ouro train` run records the real
figure, `graph_pools_gib`, which bench/shapes.py prints)."""

from __future__ import annotations

import pytest
import torch

from ouro_cli import env
from ouro_cli.rl import allocator

GIB = 2**30


def unset_allocator_settings(monkeypatch) -> None:
    """Unset for the test, and restored (or unset again) after it, whatever the test sets."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")


@pytest.fixture
def cuda_present(monkeypatch):
    unset_allocator_settings(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


def test_prepare_asks_for_expandable_segments_unless_told_otherwise(cuda_present, monkeypatch):
    allocator.prepare(disaggregated=True)  # CUDA IPC between the PD workers: PyTorch's default
    assert not env.is_set("PYTORCH_CUDA_ALLOC_CONF")
    allocator.prepare(disaggregated=False)
    assert env.get("PYTORCH_CUDA_ALLOC_CONF") == allocator.EXPANDABLE == allocator.settings()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's own wins
    allocator.prepare(disaggregated=False)
    assert allocator.settings() == "max_split_size_mb:512"


def test_prepare_tells_an_allocator_that_already_read_its_settings(cuda_present, monkeypatch):
    told = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", told.append)
    allocator.prepare(disaggregated=False)
    assert told == [allocator.EXPANDABLE]


def test_prepare_does_nothing_without_cuda(monkeypatch):
    unset_allocator_settings(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    allocator.prepare(disaggregated=False)
    assert not env.is_set("PYTORCH_CUDA_ALLOC_CONF") and allocator.settings() == "PyTorch's defaults"


@pytest.mark.parametrize(("outside_gib", "expected_gib"), [(1.0, 122.8), (5.0, 120.8)])
def test_cap_is_the_budget_less_the_reserve_or_what_is_outside(monkeypatch, outside_gib, expected_gib):
    """The allocator may hold the budget less the larger of the runtime reserve and the memory
    the process already holds outside it, as a fraction of the device's total."""
    total, budget, reserve = 140 * GIB, int(125.8 * GIB), 3 * GIB
    set_to = {}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GIB, total))
    monkeypatch.setattr(allocator, "outside_bytes", lambda device: int(outside_gib * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: set_to.update({device: f}))
    allocator.cap(torch.device("cuda", 0), budget, reserve)
    assert set_to[torch.device("cuda", 0)] * total == pytest.approx(expected_gib * GIB, rel=1e-9)
    allocator.cap(torch.device("cpu"), budget, reserve)  # host memory has no allocator cap
    assert list(set_to) == [torch.device("cuda", 0)]


def test_graph_pool_bytes_counts_the_private_pools_of_one_device(monkeypatch):
    segments = [
        {"device": 0, "total_size": 4 * GIB, "segment_pool_id": (0, 0)},  # the ordinary pool
        {"device": 0, "total_size": 2 * GIB, "segment_pool_id": (1, 3)},  # a graph pool
        {"device": 0, "total_size": 1 * GIB, "segment_pool_id": [1, 4]},  # another, as a list
        {"device": 1, "total_size": 8 * GIB, "segment_pool_id": (1, 3)},  # another device
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert allocator.graph_pool_bytes(0) == 3 * GIB
    assert allocator.graph_pool_bytes(1) == 8 * GIB
    assert allocator.graph_pool_bytes(2) == 0
