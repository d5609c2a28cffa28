"""What each phase of one GRPO update would take at the hardware's limit, from the figures a
run's `metrics.jsonl` records (bench/e2e.py prints them beside the measured times).

- **Rollout**: the bytes roofline. One decode step reads the layer stack once per loop (K
  loops) plus the lm_head, and every running sequence's cached K/V: K planes of its whole
  context. At the limit, every sample decodes in one wave, so the steps are the longest
  response; the K/V bytes are the sum over samples of (prompt + i) x K planes for each
  decoded token i. Where the engine shares a group's prompt (the built-in local engine;
  engine/cascade.py reads a shared prefix once per group), the prompt's planes count once per
  group for each step while any of its samples decodes, that is prompt x the group's longest
  response, and each sample adds only its own i. With the fp8 cache a value takes its packed
  row's bytes (model/kv_quant.py `row_bytes`: head_dim fp8 values, the scale, padding) over
  head_dim instead of 2. Prompt lengths are not recorded: their mean is taken from the prefill
  counters (tokens prefilled + tokens shared over samples; a preempted sequence's re-prefill
  inflates it a little, in the limit's favour). Prefill is left out (a few hundred tokens per
  prompt: under 1 % of the bytes at these shapes).
- **Train**: model FLOPs at `--flops` (780 TFLOP/s, H200 bf16 dense). Model FLOPs count
  what the depths require, forward and backward (3 x forward): per required layer token the
  projections and MLP (2 x their parameters) and causal attention (4 x position x query
  width), and the lm_head once per token.
- **Publish**: copying the trainer's weights into the engine's: read + write of every
  parameter at the copy bandwidth.

The whole update's limit is the sum of the three.
"""

from __future__ import annotations

from typing import Any

COPY_BANDWIDTH = 4.26e12  # bytes/s, the H200's measured device-to-device copy (bench/decode.py)
TRAIN_FLOPS = 780e12  # FLOP/s, H200 bf16 dense matmul


def layer_stack_params(c) -> int:
    """Parameters of one pass over the shared layers (projections, MLP, norms)."""
    d = c.dim_per_head
    per_layer = (
        c.hidden_size * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        + 3 * c.hidden_size * c.intermediate_size
        + 4 * c.hidden_size
    )
    return per_layer * c.num_hidden_layers


def mean_prompt_tokens(r: dict[str, Any]) -> float:
    samples = max(sum(r["rank_samples"]), 1)
    return (r.get("engine_prefill_tokens", 0) + r.get("engine_prefill_tokens_shared", 0)) / samples


def kv_value_bytes(c, fp8: bool) -> float:
    """Bytes one cached K (or V) value takes: bf16's 2, or an fp8 packed row's share."""
    from ouro_cli.model import kv_quant

    return kv_quant.row_bytes(c.dim_per_head, 1, fp8=True) / c.dim_per_head if fp8 else 2.0


def rollout_limit_s(
    r: dict[str, Any], c, group: int = 1, fp8: bool = False, bandwidth: float = COPY_BANDWIDTH
) -> float:
    """The rollout at the bytes roofline (module docstring). `group` > 1: the samples of each run
    of `group` consecutive responses share their prompt, read once per step; 1: every sample
    reads its own copy."""
    k, lengths = r["k"], r["response_lengths"]
    plane = 2 * c.num_hidden_layers * c.num_key_value_heads * c.dim_per_head * kv_value_bytes(c, fp8)
    p = mean_prompt_tokens(r)
    own = sum(n * (n - 1) / 2 for n in lengths)  # the positions each decoded token adds past the prompt
    groups = [lengths[i : i + group] for i in range(0, len(lengths), max(group, 1))]
    prompt = sum(p * (max(g) if group > 1 else sum(g)) for g in groups)
    kv = (prompt + own) * k * plane  # sum over decoded tokens of their context, in K planes
    weights = max(lengths, default=0) * (k * layer_stack_params(c) + c.vocab_size * c.hidden_size) * 2  # bf16
    return (kv + weights) / bandwidth


def train_model_flops(r: dict[str, Any], c) -> float:
    tokens = r["train_tokens"]
    required = r["train_layer_tokens_required"]  # sum over positions of their depth, x layers
    loops_per_token = required / max(tokens * c.num_hidden_layers, 1)
    p = mean_prompt_tokens(r)
    positions = sum((p + n) * (p + n + 1) / 2 for n in r["response_lengths"])  # sum of (position + 1)
    q_width = c.num_attention_heads * c.dim_per_head
    per_layer_token = 2 * layer_stack_params(c) / c.num_hidden_layers
    forward = (
        required * per_layer_token
        + 4 * q_width * positions * loops_per_token * c.num_hidden_layers
        + 2 * c.hidden_size * c.vocab_size * tokens
    )
    return 3 * forward


def publish_limit_s(c, elem: int = 2, bandwidth: float = COPY_BANDWIDTH) -> float:
    from ouro_cli.rl.sizing import parameter_counts

    return 2 * parameter_counts(c)[0] * elem / bandwidth


def limits(r: dict[str, Any], c, group: int = 1, fp8: bool = False) -> dict[str, float]:
    """The three phase limits of one update and their sum, in seconds (`group`, `fp8`: as
    `rollout_limit_s` takes them)."""
    out = {
        "rollout": rollout_limit_s(r, c, group, fp8),
        "train": train_model_flops(r, c) / TRAIN_FLOPS,
        "publish": publish_limit_s(c),
    }
    out["update"] = sum(out.values())
    return out


def table(result: dict[str, Any], c) -> str:
    """Per update: each phase's time, its limit and limit / time (1.00 = at the limit), and the
    trainer's model TFLOP/s; then the steady state per K (the updates after each K's first,
    which compiles and captures CUDA graphs). The rollout's limit reads a group's prompt once
    where the run shared prompts (`result["shared_prompts"]`, group size `result["shape"][1]`)
    and counts fp8 rows where its cache was fp8 (`result["kv_fp8"]`)."""
    group = result["shape"][1] if result.get("shared_prompts") else 1
    fp8 = bool(result.get("kv_fp8"))
    head = "upd K | rollout s limit ratio | train s limit ratio TFLOP/s | publish ms limit ratio | update s limit ratio"
    out = [head, "-" * len(head)]
    seen: dict[int, list[dict[str, Any]]] = {}
    for r in result["updates"]:
        lim = limits(r, c, group, fp8)
        update = r["rollout_s"] + r["train_s"] + r["publish_s"]
        tflops = lim["train"] * TRAIN_FLOPS / r["train_s"] / 1e12
        out.append(
            f"{r['update']:>3} {r['k']} | {r['rollout_s']:>9.1f} {lim['rollout']:>5.1f} "
            f"{lim['rollout'] / r['rollout_s']:>5.2f} | "
            f"{r['train_s']:>7.1f} {lim['train']:>5.1f} {lim['train'] / r['train_s']:>5.2f} {tflops:>7.0f} | "
            f"{r['publish_s'] * 1e3:>10.1f} {lim['publish'] * 1e3:>5.1f} "
            f"{lim['publish'] / max(r['publish_s'], 1e-9):>5.2f} | "
            f"{update:>8.1f} {lim['update']:>5.1f} {lim['update'] / update:>5.2f}"
        )
        seen.setdefault(r["k"], []).append(r)
    for k, rows in sorted(seen.items()):
        steady = rows[1:]
        if not steady:
            out.append(f"K={k}: no steady-state update (the first at each K compiles); run more --updates")
            continue
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        roll, train = mean([r["rollout_s"] for r in steady]), mean([r["train_s"] for r in steady])
        pub = mean([r["publish_s"] for r in steady])
        each = [limits(r, c, group, fp8) for r in steady]
        lim = {key: mean([x[key] for x in each]) for key in ("rollout", "train", "update")}
        tflops = mean([x["train"] * TRAIN_FLOPS / r["train_s"] / 1e12 for x, r in zip(each, steady, strict=True)])
        out.append(
            f"K={k} steady ({len(steady)} updates): update {roll + train + pub:.1f} s against a limit of "
            f"{lim['update']:.1f} s (ratio {lim['update'] / (roll + train + pub):.2f}); rollout {roll:.1f} s "
            f"({lim['rollout'] / roll:.2f} of the bytes roofline), train {train:.1f} s ({tflops:.0f} model "
            f"TFLOP/s, {lim['train'] / train:.2f} of {TRAIN_FLOPS / 1e12:.0f})"
        )
        compiling = mean([r.get("compile_s", 0.0) for r in steady])
        if compiling >= 0.5:  # a steady update should compile nothing: say so where one did
            out.append(
                f"  K={k}: the steady updates still compiled {compiling:.1f} s on average (in the figures above)"
            )
    return "\n".join(out)
