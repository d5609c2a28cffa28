"""`deterministic_kernels`: switched on for a CUDA step only, and put back afterwards
(the engine in the same process keeps its own settings), also when the step raises."""

from __future__ import annotations

import os

import pytest
import torch

from ouro_cli.trainer.determinism import deterministic_kernels


def _state():
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )


@pytest.fixture
def outside():
    before = _state()
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield _state()
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = before[2]


@pytest.mark.parametrize(("capability", "workspace"), [((8, 0), ":4096:8"), ((9, 0), None)], ids=["a100", "h200"])
def test_cuda_step_runs_deterministic_then_restores(outside, monkeypatch, capability, workspace):
    """On an A100 the cuBLAS workspace variable is set to ":4096:8"; on an H200, whose
    PyTorch default is that size already, it stays unset (PyTorch re-parses it per matmul)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    with deterministic_kernels(torch.device("cuda", 0)):  # sets flags only: no GPU needed
        assert _state() == (True, True, False)
        assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == workspace
    assert _state() == outside
    with pytest.raises(RuntimeError), deterministic_kernels(torch.device("cuda", 0)):
        raise RuntimeError("a failing step")
    assert _state() == outside


@pytest.mark.parametrize(("device", "enabled"), [("cpu", True), ("cuda", False)])
def test_cpu_or_disabled_leaves_everything(outside, device, enabled):
    with deterministic_kernels(torch.device(device), enabled):
        assert _state() == outside
    assert _state() == outside
