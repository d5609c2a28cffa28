"""The whole-sequence forward's attention in the decode kernel's reduction order
(`--replay-attention paged`; model/attention.py dispatches here).

Why: on a GPU the engine's decode attention (decode_attention.py) and the trainer's SDPA
reduce the same softmax in different tile orders, so their bf16 logprobs part from the
first layer on (bench/agree_trace.py on the H200), even where the projections match bit
for bit (kernels/gemv.py). Here every query of the replay runs the decode kernel itself
over its own visible keys: tiles of BLOCK positions at the same offsets from its
document's start, the same fp32 online softmax, P rounded the same way. The kernel's
batch invariance (a row's bits do not depend on its batch-mates or the table's width)
makes a query's output the bits a decode step computes for that token over the same K/V.

The backward is SDPA's gradient of the same attention, recomputed: this mode changes how
the forward rounds, not the function that is differentiated.

Measured on the H200 (1.4B shape, bf16, with `--decode-gemv triton`, bench/agree_trace.py):
it did not narrow the agreement there (mean |Δ logprob| over 32 tokens 0.0656, against
0.0659 with SDPA; still 3e-3 relative after loop 1, layer 0), so the divergence starts in
another operation. On CPU under the Triton interpreter it makes them bitwise equal.

Cost: no query shares its K/V reads with its neighbours (O(S²) reads per head) and
G = Hq/Hkv heads fill a 16-row MMA tile. This is an exactness mode to measure and use
where agreement matters more than training speed, not the default.

Visible keys must be one contiguous run ending at the query, as SequenceLayout builds
them (causal, documents contiguous in a row, padding on the edges): other masks are
refused.
"""

from __future__ import annotations

import torch

from ouro_cli.model.exact import reference_backward, visible_runs

from .decode_attention import paged_decode_attention

# The slot table of the last layout: every layer and loop of one forward shares its mask, so
# the check and the [B·S, S] table are built once per forward, not once per layer call.
_last_layout: list = [None, None, None]  # mask, (B, S, device), (slots, lengths)


def _slot_table(mask: torch.Tensor | None, b: int, s: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [B·S, S], lengths [B·S]): query (b, i) reads slots b·S + start .. b·S + i."""
    shape = (b, s, device)
    if _last_layout[0] is mask and _last_layout[1] == shape:
        return _last_layout[2]
    start, length = visible_runs(mask, b, s, device, "--replay-attention paged")
    row_base = (torch.arange(b, device=device) * s)[:, None] + start  # [B, S]
    slots = row_base.reshape(-1, 1) + torch.arange(s, device=device)[None, :]
    slots = slots.clamp(max=b * s - 1)  # past a query's length the kernel masks its loads
    _last_layout[:] = [mask, shape, (slots, length.reshape(-1))]
    return _last_layout[2]


def paged_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D] through the decode kernel, one query per row.
    With `rows` [N] (flat indices b·S + i), q [1,N,Hq,D] holds only those positions' queries
    (a loop that only they run, model/attention.py `attention_at_rows`) -> [1,N,Hq,D]: each
    query reads the same table row, so its bits are those it has among all B·S."""
    b, s, hkv, d = k.shape
    hq = q.shape[2]
    slots, lengths = _slot_table(mask, b, s, q.device)
    if rows is not None:
        slots, lengths = slots.index_select(0, rows), lengths.index_select(0, rows)
    # one plane per kv head over all B·S positions
    k_plane = k.reshape(b * s, hkv, d).transpose(0, 1).contiguous()
    v_plane = v.reshape(b * s, hkv, d).transpose(0, 1).contiguous()
    o = paged_decode_attention(q.reshape(-1, hq, d), k_plane, v_plane, slots, lengths)
    return o.view(q.shape)


class _PagedReplayAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, reference, rows):
        ctx.save_for_backward(q, k, v)
        ctx.mask, ctx.reference = mask, reference
        return paged_forward(q, k, v, mask, rows)

    @staticmethod
    def backward(ctx, grad):
        return reference_backward(ctx, grad, extra=3)  # mask, reference, rows


def paged_replay_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           reference, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The forward in the decode kernel's order (only the queries at `rows`, as `paged_forward`);
    gradients from `reference(q, k, v, mask)` (the SDPA attention of model/attention.py)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
        return paged_forward(q, k, v, mask, rows)
    return _PagedReplayAttention.apply(q, k, v, mask, reference, rows)
