"""The trainer's replay attention on CUDA runs fused kernels, packed rows included.

Unpacked causal rows go to flash attention; packed rows (document masking) and padded
rows carry a boolean mask, which SDPA serves with its fused memory-efficient kernel.
Restricting SDPA to the fused backends makes a silent fallback to the unfused math
path an error here. A loop that only some positions run (`attention_at_rows`: their queries
in a padded block, always with a mask) is served by a fused kernel too.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ouro_cli.model.attention import QueryRows, SequenceLayout, attention_at_rows, dense_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("packed", [False, True])
def test_replay_attention_uses_fused_kernels(packed):
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 256, 4, 64
    ids = torch.zeros(b, s, dtype=torch.long)
    docs = (torch.arange(s) // 100).expand(b, s).contiguous() if packed else None
    layout = SequenceLayout.build(ids.cuda(), document_ids=None if docs is None else docs.cuda())
    q, k, v = (torch.randn(b, s, h, d, generator=g).cuda().bfloat16() for _ in range(3))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        fused = dense_attention(q, k, v, layout.mask)
    with sdpa_kernel([SDPBackend.MATH]):
        reference = dense_attention(q.float(), k.float(), v.float(), layout.mask)
    assert (fused.float() - reference).abs().max() < 2e-2


@pytest.mark.parametrize("packed", [False, True])
def test_attention_at_some_rows_uses_fused_kernels(packed):
    g = torch.Generator().manual_seed(1)
    b, s, h, d = 2, 256, 4, 64
    ids = torch.zeros(b, s, dtype=torch.long)
    docs = (torch.arange(s) // 100).expand(b, s).contiguous() if packed else None
    layout = SequenceLayout.build(ids.cuda(), document_ids=None if docs is None else docs.cuda())
    queries = QueryRows.build((torch.rand(b, s, generator=g) < 0.4).cuda(), layout.mask)
    q, k, v = (torch.randn(b, s, h, d, generator=g).cuda().bfloat16() for _ in range(3))
    q_rows = q.flatten(0, 1)[queries.rows][None]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        fused = attention_at_rows(
            q_rows, k, v, queries.rows, queries.slots, queries.mask, layout.mask, queries.slot_inverse
        )
    with sdpa_kernel([SDPBackend.MATH]):
        reference = dense_attention(q.float(), k.float(), v.float(), layout.mask).flatten(0, 1)[queries.rows]
    assert (fused[0].float() - reference).abs().max() < 2e-2
