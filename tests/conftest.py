"""Shared test setup: GPU tests are skipped without CUDA; CPU tests run in fp32 and
deterministic mode so that equality checks mean what they say."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
