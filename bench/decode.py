"""Decode throughput of the rollout engine against the memory-bandwidth roofline.

    python bench/decode.py                      # CPU: tiny model, fp32
    python bench/decode.py --device cuda        # CUDA: Ouro-1.4B shape, random bf16 weights

Decode at a fixed budget K reads, every step, the layer weights K times and, for every
cached token of every sequence, its K/V in the K planes it attends to (docs/performance.md#how-to-read-it):

    bytes/step = K × layer_weight_bytes + B × context × K × L × 2 × Hkv × D × elem
    roofline tok/s = B / (bytes/step / bandwidth)

At Ouro-1.4B, K = 4 and 4.26e12 B/s this gives ≈ 420 tok/s at batch 1 and ≈ 14k tok/s at
batch 64 with ~200 tokens of context. Decode time is measured as the time of a run
with `new_tokens + 1` tokens minus the time it spent in prefill (which samples the first
token), so it holds `new_tokens` decode steps. Not part of the test run.

    python bench/decode.py --compare async        # sync vs async scheduling, threshold exits
    python bench/decode.py --compare speculative  # plain K = T vs self-speculation
    python bench/decode.py --device cuda --compare groups --batch 256 --prompt 100 --new-tokens 512

`--compare async` decodes with exit threshold τ (`--exit-threshold`) three ways: sync
immediate exits, sync delayed exits, and `LLM(async_scheduling=True)` (delayed exits,
the exit signal read one loop late); async against sync delayed isolates the cost of
the per-loop host sync, since both run the same loops (eager steps: a CUDA graph
runs every loop and never reads an exit signal on the host). `--compare speculative` decodes
at K = T plainly and with `--speculative-tokens` drafts of `--draft-loops` loops, and
prints the acceptance rate. `--compare groups` decodes GRPO groups (`--group-size` samples
of each prompt) with each prompt's KV copied into every sample's blocks (`share_prompts=False`),
with the samples sharing the prompt's blocks, with the cascade attention reading them once per
group, and with that on an fp8 KV cache; the cache holds the whole batch in every mode, so the
lines differ by what a step reads, not by how many sequences fit. Each line gives tok/s and the
ratio to the first line.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from ouro_cli.engine import LLM, SamplingParams  # noqa: E402
from ouro_cli.model import OuroConfig, OuroForCausalLM, tiny_config  # noqa: E402


def random_model(config: OuroConfig, dtype: torch.dtype, device: str) -> OuroForCausalLM:
    """Random weights created directly on the device (a 1.4B init on the host is slow)."""
    with torch.device(device):
        model = OuroForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, 0.02)
    return model.to(dtype=dtype)


def layer_weight_bytes(config: OuroConfig, elem: int) -> int:
    """Bytes of the shared layer stack (one pass over all layers); embeddings and lm_head excluded."""
    h, i, d = config.hidden_size, config.intermediate_size, config.dim_per_head
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    per_layer = h * hq * d * 2 + h * hkv * d * 2 + 3 * h * i + 4 * h
    return per_layer * config.num_hidden_layers * elem


def roofline_tokens_per_s(config: OuroConfig, k: int, batch: int, context: float, elem: int, bandwidth: float) -> float:
    kv_per_token_per_plane = config.num_hidden_layers * 2 * config.num_key_value_heads * config.dim_per_head * elem
    step_bytes = k * layer_weight_bytes(config, elem) + batch * context * k * kv_per_token_per_plane
    return batch / (step_bytes / bandwidth)


def make_prompts(batch: int, prompt_len: int, vocab: int, group: int = 1) -> list[list[int]]:
    """`batch` random prompts: batch / group distinct ones, each `group` times in a row."""
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(1, vocab, (prompt_len,), generator=g).tolist() for _ in range(-(-batch // group))]
    return [p for p in distinct for _ in range(group)][:batch]


def agree_policies(loops: int) -> list[tuple[int, float]]:
    """The agreement benches' decode policies: (max_loops, exit threshold) for the fixed
    budgets K = 2, 3, 4 and threshold exits (τ = 0.7) at T = `loops`."""
    return [(k, 1.0) for k in (2, 3, 4) if k <= loops] + [(loops, 0.7)]


def rollout_engine(model: OuroForCausalLM, rows: int, prompt_len: int, new_tokens: int) -> LLM:
    """An engine whose KV cache holds `rows` sequences of prompt + new tokens at once."""
    per_seq = -(-(prompt_len + new_tokens + 1) // 16)
    return LLM(model, max_num_seqs=rows, kv_blocks=rows * per_seq, block_size=16, max_prefill_tokens=rows * prompt_len)


def rollout_params(rows: list[tuple[int, float]], new_tokens: int) -> list[SamplingParams]:
    """Seeded temperature-1 sampling per (max_loops, exit threshold) row, reporting the
    processed logprob of every sampled token."""
    return [
        SamplingParams(
            max_tokens=new_tokens,
            temperature=1.0,
            seed=100 + i,
            logprobs=0,
            logprobs_mode="processed",
            ignore_eos=True,
            max_loops=k,
            exit_threshold=tau,
        )
        for i, (k, tau) in enumerate(rows)
    ]


def timed_generate(llm: LLM, prompts: list[list[int]], n: int, k: int, device: str, **params_kw) -> tuple[float, float]:
    """(seconds of one `generate` of `n` tokens per prompt at K = `k`, device synchronised;
    seconds of it spent in prefill). Prefill ends with a sampled token read on the host,
    so its wall time is device-complete without an extra sync."""
    params = SamplingParams(max_tokens=n, max_loops=k, temperature=1.0, seed=0, ignore_eos=True, **params_kw)
    prefill_s = 0.0
    original = llm.core.prefill

    def prefill(*args, **kw):
        nonlocal prefill_s
        start = time.perf_counter()
        try:
            return original(*args, **kw)
        finally:
            prefill_s += time.perf_counter() - start

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    llm.core.prefill = prefill
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    finally:
        del llm.core.prefill
    assert all(len(o.output_token_ids) == n for o in outs)
    return time.perf_counter() - start, prefill_s


def measure(
    llm: LLM, batch: int, prompt_len: int, new_tokens: int, k: int, vocab: int, device: str, group=1, **params_kw
) -> float:
    """Seconds of `new_tokens` decode steps (sampling and scheduling included): a run of
    new_tokens + 1 tokens minus the time it spent in prefill (which samples the first token).

    Prefill runs one sequence at a time, eagerly; at batch 128 it takes seconds and varies
    by a good fraction of the decode time, so it is timed and taken out rather than
    estimated by a second run. The warm-up is a full-length run: CUDA graphs are captured
    per context-width bucket, so a shorter warm-up would leave captures in the timed run."""
    prompts = make_prompts(batch, prompt_len, vocab, group)
    timed_generate(llm, prompts, new_tokens + 1, k, device, **params_kw)  # warm-up
    total, prefill = timed_generate(llm, prompts, new_tokens + 1, k, device, **params_kw)
    return total - prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=["tiny", "1.4b"], help="default: tiny on CPU, 1.4b on CUDA")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--loops", "-K", type=int, default=4)
    ap.add_argument("--bandwidth", type=float, default=4.26e12, help="bytes/s for the roofline (H200 copy: 4.26e12)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--compare", choices=["none", "async", "speculative", "groups"], default="none")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt of --compare groups")
    ap.add_argument("--exit-threshold", type=float, default=0.7, help="τ of --compare async")
    ap.add_argument("--speculative-tokens", type=int, default=3)
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="--compare: best of this many measurements")
    args = ap.parse_args()

    cuda = args.device.startswith("cuda")
    shape = args.shape or ("1.4b" if cuda else "tiny")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    config = OuroConfig() if shape == "1.4b" else tiny_config()
    torch.manual_seed(0)
    model = random_model(config, dtype, args.device)
    elem = torch.finfo(dtype).bits // 8
    print(
        f"model {shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {dtype}) on {args.device}; "
        f"K={args.loops}, prompt {args.prompt}, {args.new_tokens} new tokens, bandwidth {args.bandwidth:.3g} B/s"
    )
    if args.compare != "none":
        compare(args, model, config)
        return
    for batch in args.batch:
        tokens_per_seq = args.prompt + args.new_tokens
        blocks = batch * -(-tokens_per_seq // args.block_size)
        llm = LLM(
            model,
            max_num_seqs=batch,
            kv_blocks=blocks,
            block_size=args.block_size,
            max_prefill_tokens=batch * args.prompt,
        )
        seconds = measure(llm, batch, args.prompt, args.new_tokens, args.loops, config.vocab_size, args.device)
        llm.close()
        context = args.prompt + args.new_tokens / 2  # mean cached tokens over the decode steps
        tok_s = batch * args.new_tokens / seconds
        roof = roofline_tokens_per_s(config, args.loops, batch, context, elem, args.bandwidth)
        print(
            f"batch {batch:4d}  context {context:6.0f}  K {args.loops}  decode {tok_s:10.1f} tok/s  "
            f"roofline {roof:10.1f} tok/s  ratio {tok_s / roof:.4f}"
        )


def compare(args, model: OuroForCausalLM, config: OuroConfig) -> None:
    """Decode throughput of execution modes side by side (best of --repeats), ratio to the first."""
    t = config.total_ut_steps
    if args.compare == "async":
        tau = dict(exit_threshold=args.exit_threshold)
        eager = {"cuda_graphs": False}  # a captured step runs every loop: the host reads no exit signal there
        modes = [
            ("sync, immediate exits", eager, dict(tau, exit_mode="immediate")),
            ("sync, delayed exits", eager, dict(tau, exit_mode="delayed")),
            ("async (delayed exits)", {**eager, "async_scheduling": True}, dict(tau, exit_mode="immediate")),
        ]
        k = args.loops
    elif args.compare == "groups":
        copied = {"share_prompts": False, "cascade": False}
        fp8 = {"execution": replace(model.execution, kv_cache_dtype="fp8")}
        modes = [
            ("prompts copied per sample", copied, {}),
            ("prompt blocks shared", {"cascade": False}, {}),
            ("shared, cascade attention", {}, {}),
            ("shared, cascade, fp8 KV", fp8, {}),
        ]
        k = args.loops
    else:
        modes = [
            (f"plain K={t}", {}, {}),
            (
                f"speculative N={args.speculative_tokens} D={args.draft_loops}",
                {},
                dict(speculative_tokens=args.speculative_tokens, draft_loops=args.draft_loops),
            ),
        ]
        k = t
    print(f"compare {args.compare}: K={k}" + (f", τ={args.exit_threshold}" if args.compare == "async" else ""))
    for batch in args.batch:
        blocks = batch * -(-(args.prompt + args.new_tokens + args.speculative_tokens) // args.block_size)
        base = None
        for name, engine_kw, params_kw in modes:
            llm = LLM(
                model,
                max_num_seqs=batch,
                kv_blocks=blocks,
                block_size=args.block_size,
                max_prefill_tokens=batch * args.prompt,
                **engine_kw,
            )
            group = args.group_size if args.compare == "groups" else 1
            seconds = min(
                measure(llm, batch, args.prompt, args.new_tokens, k, config.vocab_size, args.device, group, **params_kw)
                for _ in range(args.repeats)
            )
            c = llm.work_counters()
            llm.close()
            tok_s = batch * args.new_tokens / seconds
            base = base or tok_s
            extra = ""
            if c["spec_draft_tokens"]:
                extra = f"  acceptance {c['spec_accepted_tokens'] / c['spec_draft_tokens']:.3f}"
            mean_depth = c["decode_layer_tokens"] / max(1, c["decode_tokens"]) / config.num_hidden_layers
            print(
                f"batch {batch:4d}  {name:32s} decode {tok_s:10.1f} tok/s  x{tok_s / base:.3f}  "
                f"mean loops/row {mean_depth:.2f}{extra}"
            )


if __name__ == "__main__":
    main()
