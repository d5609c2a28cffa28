"""A train step brings values back from the device once for its statistics (and, with loop
weighting, once more for the per-loop sums), never per micro-batch: on CUDA each such read (`.item()`,
`int(t)`, `.tolist()`, `nonzero`, ...) waits for the device to drain its queue and leaves it
idle while the host catches up (docs/performance.md#train). Counted on CPU with a TorchFunctionMode, by the ouro_cli
function
that asked; reads of the micro-batches' host copies (building and counting them,
trainer/batching.py; counting their depths for the forward's loop plan, LoopCounts.of) do not
wait for a device and are left out. The forward's own read of its depths is counted: a step
that did not hand it the counts would read once per micro-batch."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from _trainer_samples import make_samples
from torch.overrides import TorchFunctionMode

from ouro_cli.model import build, ouro, tiny_config

pytest.importorskip("megatron.core")

READS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "cpu",
    "numpy",
    "equal",
    "unique",
    "any",
    "all",
}


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host, by the innermost ouro_cli
    function on the stack, skipping those made for trainer/batching.py (host tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            frames = [f for f in traceback.extract_stack()[:-1] if "ouro_cli" in f.filename]
            if frames and not any(f.filename.endswith("trainer/batching.py") or _counts_on_host(f) for f in frames):
                self.sites[f"{frames[-1].filename.split('ouro_cli/')[-1]}:{frames[-1].name}"] += 1
        return func(*args, **(kwargs or {}))


def _counts_on_host(frame) -> bool:
    """LoopCounts.of: the trainer counts a micro-batch's depths from its host copy."""
    return frame.filename.endswith("model/ouro.py") and frame.name == "of"


@pytest.mark.parametrize("weighting", ["exit", "uniform"])
def test_a_step_reads_the_device_once_for_its_statistics(monkeypatch, weighting):
    """With loop weighting the step reads once more (the per-loop sums); the tokens past each
    loop are counted from the micro-batch's host copy."""
    from ouro_cli.trainer import Trainer, TrainerConfig

    monkeypatch.setattr(ouro, "GATHER_BELOW", 1.01)  # every loop that not all positions run gathers
    model = build(tiny_config(), seed=3)
    samples = make_samples(model, 8, seed=5)
    trainer = Trainer(
        model, TrainerConfig(device="cpu", max_tokens_per_micro_batch=32, prompt_heads=False, loop_weighting=weighting)
    )
    try:
        reads = HostReads()
        with reads:
            metrics = trainer.forward_backward(samples)
    finally:
        trainer.close()
    n = metrics["micro_batches"]
    assert n >= 3 and metrics["layer_tokens_executed"] < n * 32 * 4 * model.config.num_hidden_layers  # gathered
    expected = {
        "trainer/step.py:_reduce": 1,  # the statistics, with the per-depth mismatch
        "trainer/trainer.py:_global_counts": 1,
    }
    if weighting != "exit":
        expected |= {"trainer/step.py:_reduce_loops": 1}
    assert dict(reads.sites) == expected, dict(reads.sites)
    assert 0 <= metrics["logprob_mismatch_mean"] <= metrics["logprob_mismatch_max"]
    by_depth = metrics["logprob_mismatch_mean_by_depth"]
    assert by_depth and all(0 <= v <= metrics["logprob_mismatch_max_by_depth"][d] for d, v in by_depth.items())


def test_a_forward_reads_its_depths_once():
    """Padding, packed documents and gathered loops: one read, and the bits of a forward that
    reads them loop by loop (GATHER_BELOW's default)."""
    model = build(tiny_config(), seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 12), generator=g)
    depths = torch.randint(1, 5, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    reads = HostReads()
    with torch.no_grad(), reads:
        out = model(ids, depths, attention_mask=mask)
    assert dict(reads.sites) == {"model/ouro.py:read": 1}
    counted = HostReads()  # the counts made by the caller from host copies: no read, the same bits
    with torch.no_grad(), counted:
        again = model(
            ids, depths, attention_mask=mask, depth_counts=ouro.LoopCounts.of(depths, mask, model.config.num_loops)
        )
    assert dict(counted.sites) == {} and torch.equal(again, out)
    with pytest.raises(ValueError, match="depths must lie in 1..4"):
        model(ids, depths + 1, attention_mask=mask)
    assert torch.isfinite(out).all()
