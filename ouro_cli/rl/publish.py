"""Weight publication from the trainer to the engine (docs/model.md §5), in size-bounded buckets.

`start_weight_update(version)` → `update_weights(bucket)`* → `finish_weight_update()`.
Buckets hold whole tensors up to `bucket_bytes`, so a transport that stages a bucket at
a time never needs a second copy of the model. A failure in the middle leaves the engine
blocked (its contract); the loop does not continue on a half-published policy.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

DEFAULT_BUCKET_BYTES = 256 << 20


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def publish(
    engine, named: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> dict[str, float]:
    start = time.perf_counter()
    engine.start_weight_update(version)
    count = nbytes = 0
    for bucket in buckets(named, bucket_bytes):
        engine.update_weights(bucket)
        count += 1
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    engine.finish_weight_update()
    return {"publish_s": time.perf_counter() - start, "publish_buckets": count, "publish_bytes": nbytes}
