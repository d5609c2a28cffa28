"""Shared test setup: GPU tests are skipped without CUDA; tests marked slow are collected
first; CPU tests run in fp32 and deterministic mode so that equality checks mean what they say."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # slow tests first (stable, so a file's tests stay together): under `--dist loadfile` the
    # longest files start at once instead of one of them starting last and running alone
    items.sort(key=lambda item: "slow" not in item.keywords)
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
