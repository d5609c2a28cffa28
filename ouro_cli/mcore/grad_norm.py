"""A gradient norm for megatron-core's clipping that never waits for the device.

Without apex or Transformer Engine, megatron-core's `clip_grads` takes the global L2 norm
through `local_multi_tensor_l2_norm`, which builds a host tensor out of one device scalar
per parameter: a `.item()` each, one host wait per parameter tensor in every optimizer
step (why: docs/performance.md#train). `use_sync_free_grad_norm()` puts torch's own
`torch.nn.utils.get_total_norm` in its place (the per-tensor norms in a few fused launches,
their norm on the device): the same function of the gradients, one host read left, the
optimizer step's own. Where apex or Transformer Engine provide the norm, nothing changes.
"""

from __future__ import annotations

import torch


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron's `l2_norm_impl`: (the global L2 norm of every tensor of the lists as
    an fp32 tensor of shape [1] on their device, None)."""
    tensors = [t for group in tensor_lists for t in group]
    return torch.nn.utils.get_total_norm(tensors, 2.0).float().reshape(1), None


def use_sync_free_grad_norm() -> None:
    """Route megatron-core's clipping norm through `_l2_norm` where it would use its host-bound
    fallback (idempotent)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm
