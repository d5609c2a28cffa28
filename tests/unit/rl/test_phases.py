"""The measured phases of an update (ouro_cli/rl/phases.py): time, compile time, and an
out-of-memory error turned into one line naming the phase, its size and the option to lower."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.errors import ResourceError
from ouro_cli.rl.phases import phase


def test_a_phase_records_its_time_and_no_peak_on_cpu():
    metrics: dict = {}
    with phase(metrics, "train", torch.device("cpu"), "4 samples", "--max-tokens-per-micro-batch"):
        pass
    assert metrics["train_s"] >= 0 and metrics["train_compile_s"] == 0.0
    assert metrics["peak_memory_train_gib"] is None and metrics["train_alloc_retries"] is None


def test_out_of_memory_is_one_line_naming_phase_size_and_option():
    metrics: dict = {}
    with pytest.raises(ResourceError) as err:
        with phase(
            metrics,
            "train",
            torch.device("cpu"),
            "update 3, 256 samples in micro-batches of up to 12032 tokens, recompute off",
            "--max-tokens-per-micro-batch or --gpu-memory-utilization",
        ):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a 60-line report)")
    assert str(err.value) == (
        "out of host memory in the train phase (update 3, 256 samples in micro-batches of up "
        "to 12032 tokens, recompute off); lower --max-tokens-per-micro-batch or "
        "--gpu-memory-utilization"
    )
    assert ResourceError.exit_code == 1 and "train_s" in metrics  # timed even when it fails


def test_other_errors_pass_through():
    with pytest.raises(ValueError, match="not memory"):
        with phase({}, "rollout", torch.device("cpu"), "x", "y"):
            raise ValueError("not memory")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_phase_on_cuda_records_its_peak_and_its_allocator_retries():
    metrics: dict = {}
    with phase(metrics, "train", torch.device("cuda"), "4 samples", "--max-tokens-per-micro-batch"):
        x = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    assert metrics["peak_memory_train_gib"] >= 0.25 and metrics["train_alloc_retries"] >= 0
    del x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_peak_before_the_kv_cache_is_mapped_does_not_add_to_the_caches():
    """The optimizer state leaves the device before a rollout maps its cache: the phase's peak
    is the larger of the two moments, not their sum (engine/kv_memory.py `peak_bytes`)."""
    pytest.importorskip("cuda.bindings")
    from ouro_cli.engine.kv_memory import ReservedBuffer

    gib = 2**30
    torch.cuda.empty_cache()  # what earlier tests left cached
    buffer = ReservedBuffer(gib, torch.uint8, torch.device("cuda"))
    metrics: dict = {}
    with phase(metrics, "rollout", torch.device("cuda"), "x", "y"):
        state = torch.empty(gib, dtype=torch.uint8, device="cuda")
        del state
        torch.cuda.empty_cache()
        cache = buffer.take(gib)
    assert 1.0 <= metrics["peak_memory_rollout_gib"] < 1.5, metrics
    assert 1.0 <= metrics["peak_held_rollout_gib"] < 1.5, metrics
    assert metrics["memory_outside_gib"] > 0, metrics  # the CUDA context
    del cache
    buffer.close()
