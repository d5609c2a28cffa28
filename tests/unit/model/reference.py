"""An independent dense fp64 reference of Ouro (docs/model.md §2–3), written with plain loops.

It shares no code with ouro_cli.model: tokens are processed one at a time, each runs its
own number of loops, and every (loop, layer) keeps a KV plane per token with the
last-exited layout (planes past a token's depth hold a copy of its last plane). This is
the per-token execution that the model's masked whole-sequence forward must reproduce.
"""

from __future__ import annotations

import math

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / math.sqrt(float((x * x).mean()) + eps))


def _rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    d = x.shape[0]
    half = d // 2
    out = x.clone()
    for i in range(half):
        # docs/model.md §2: the angles and cos/sin are computed in fp32, whatever the model dtype.
        inv_freq = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(theta, dtype=torch.float32) ** torch.tensor(
            2 * i / d, dtype=torch.float32
        )
        angle = torch.tensor(float(pos), dtype=torch.float32) * inv_freq
        c, s = float(torch.cos(angle)), float(torch.sin(angle))
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def reference_logits(state: dict[str, torch.Tensor], cfg, tokens: list[int], depths: list[int]) -> torch.Tensor:
    """Logits [S, V] in fp64 for one sequence, position j running depths[j] loops."""
    w = {k: v.detach().double() for k, v in state.items()}
    n_layers, loops = cfg.num_hidden_layers, cfg.total_ut_steps
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = cfg.hidden_size // hq if cfg.head_dim is None else cfg.head_dim
    eps, theta = cfg.rms_norm_eps, cfg.rope_theta
    keys = {(t, layer_i): [] for t in range(1, loops + 1) for layer_i in range(n_layers)}
    values = {(t, layer_i): [] for t in range(1, loops + 1) for layer_i in range(n_layers)}
    out = []
    for j, tok in enumerate(tokens):
        h = w["model.embed_tokens.weight"][tok].clone()
        for t in range(1, depths[j] + 1):
            for layer_i in range(n_layers):
                p = f"model.layers.{layer_i}."
                x = _rms(h, w[p + "input_layernorm.weight"], eps)
                q = (w[p + "self_attn.q_proj.weight"] @ x).view(hq, dh)
                k = (w[p + "self_attn.k_proj.weight"] @ x).view(hkv, dh)
                v = (w[p + "self_attn.v_proj.weight"] @ x).view(hkv, dh)
                k = torch.stack([_rope(k[i], j, theta) for i in range(hkv)])
                keys[(t, layer_i)].append(k)
                values[(t, layer_i)].append(v)
                heads = []
                for head in range(hq):
                    g = head // (hq // hkv)
                    qh = _rope(q[head], j, theta)
                    scores = torch.tensor(
                        [float(qh @ keys[(t, layer_i)][i][g]) / math.sqrt(dh) for i in range(j + 1)],
                        dtype=torch.float64,
                    )
                    probs = torch.softmax(scores, dim=0)
                    heads.append(sum(probs[i] * values[(t, layer_i)][i][g] for i in range(j + 1)))
                attn = w[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
                h = h + _rms(attn, w[p + "input_layernorm_2.weight"], eps)
                x2 = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
                gate = w[p + "mlp.gate_proj.weight"] @ x2
                mlp = w[p + "mlp.down_proj.weight"] @ (gate * torch.sigmoid(gate) * (w[p + "mlp.up_proj.weight"] @ x2))
                h = h + _rms(mlp, w[p + "post_attention_layernorm_2.weight"], eps)
            h = _rms(h, w["model.norm.weight"], eps)
        for t in range(depths[j] + 1, loops + 1):  # last-exited: copy the last real plane
            for layer_i in range(n_layers):
                keys[(t, layer_i)].append(keys[(depths[j], layer_i)][j])
                values[(t, layer_i)].append(values[(depths[j], layer_i)][j])
        out.append(w["lm_head.weight"] @ h)
    return torch.stack(out)


def reference_exit_cdf(lambdas: list[float]) -> list[float]:
    """CDF of the exit distribution, term by term from its definition."""
    T = len(lambdas)
    probs = []
    for t in range(T):
        survive = 1.0
        for s in range(t):
            survive *= 1.0 - lambdas[s]
        probs.append(survive if t == T - 1 else lambdas[t] * survive)
    cdf, acc = [], 0.0
    for p in probs:
        acc += p
        cdf.append(acc)
    return cdf
