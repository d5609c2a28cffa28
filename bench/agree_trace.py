"""Where the engine and the trainer part ways in bf16: per-(loop, layer) divergence of one token.

    python bench/agree_trace.py --device cuda                  # Ouro-1.4B shape, random bf16 weights
    python bench/agree_trace.py --device cuda --sdpa math      # replay attention on SDPA's math kernel
    python bench/agree_trace.py --device cuda --attention torch
    python bench/agree_trace.py --device cuda --replay-attention paged --decode-gemv triton
                                                               # replay attention in the decode kernel's order,
                                                               # projections with many-row bits (exactness mode)
    python bench/agree_trace.py --device cpu --shape tiny      # smoke run

The engine decodes one sequence at K = T eagerly (no CUDA graph, so forward hooks see
every layer call) and records each decoder layer's output for the token of its last
decode step, at every (loop, layer). A second model holding a copy of the same weights
(unfused, as the trainer's is) replays the whole sequence the way the trainer does and
records the same outputs at that position. Printed per loop: the relative max |Δ| at a
few layers; then, for the first layer call whose output differs, its attention input,
q and k after RoPE, attention output, MLP input and output (which operation parts
first); then the two log-probabilities of the sampled token.

Reading it: a difference at bf16 rounding level (~4e-3) from layer 0 of loop 1 that
grows along the loops is rounding amplified by depth; a jump at one layer, or a large
difference in the first layer, names an operation that differs (then vary `--sdpa`,
`--attention`, `--replay-attention` and `--decode-gemv`, the execution settings of
ouro_cli/settings.py). Not part of the test run.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import decode as decode_bench  # noqa: E402

from ouro_cli.engine import LLM, SamplingParams  # noqa: E402
from ouro_cli.model import OuroConfig, from_state_dict, tiny_config  # noqa: E402
from ouro_cli.settings import ExecutionSettings  # noqa: E402


def record_layers(model, rows: list[torch.Tensor], pick) -> list:
    """Forward hooks appending `pick(h')` of every decoder layer call to `rows` (a layer returns
    (h', the next norm of h'))."""
    return [
        layer.register_forward_hook(lambda _m, _a, out: rows.append(pick(out[0]).float().cpu()))
        for layer in model.model.layers
    ]


TAPS = ("attention in", "q rotated", "k rotated", "attention out", "MLP in", "MLP out")


class _Removable:
    def __init__(self, undo) -> None:
        self.remove = undo


def record_sublayers(model, taps: dict[str, list], pick) -> list:
    """Hooks appending `pick(...)` of each layer's attention and MLP inputs and outputs, and of
    q and k after RoPE, to `taps` (one list per name in TAPS, one entry per layer call).
    q and k come from wrapping pointwise.rotary (undone by the last returned hook's remove)."""
    from ouro_cli.model import pointwise

    def keep(name, which):
        return lambda _m, args, *out: taps[name].append(pick(out[0] if which == "out" else args[0]).float().cpu())

    hooks = []
    for layer in model.model.layers:
        hooks += [
            layer.self_attn.register_forward_pre_hook(keep("attention in", "in")),
            layer.self_attn.register_forward_hook(keep("attention out", "out")),
            layer.mlp.register_forward_pre_hook(keep("MLP in", "in")),
            layer.mlp.register_forward_hook(keep("MLP out", "out")),
        ]
    rotary = pointwise.rotary

    def recording_rotary(q, k, cos, sin):
        q, k = rotary(q, k, cos, sin)
        taps["q rotated"].append(pick(q).float().cpu())
        taps["k rotated"].append(pick(k).float().cpu())
        return q, k

    pointwise.rotary = recording_rotary

    def undo() -> None:
        pointwise.rotary = rotary

    return hooks + [_Removable(undo)]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=["tiny", "1.4b"], help="default: 1.4b on CUDA, tiny on CPU")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--sdpa",
        choices=["default", "math", "flash", "efficient", "cudnn"],
        default="default",
        help="SDPA backend of the replay's attention",
    )
    ap.add_argument(
        "--attention",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="the engine's decode attention (execution setting decode_attention)",
    )
    ap.add_argument(
        "--replay-attention",
        choices=["sdpa", "paged"],
        default="sdpa",
        help="the replay's attention (execution setting replay_attention)",
    )
    ap.add_argument(
        "--decode-gemv",
        choices=["auto", "cublas", "triton"],
        default="auto",
        help="the engine's projections (execution setting decode_gemv)",
    )
    args = ap.parse_args()
    execution = ExecutionSettings(
        decode_attention=args.attention, replay_attention=args.replay_attention, decode_gemv=args.decode_gemv
    )
    cuda = args.device.startswith("cuda")
    shape = args.shape or ("1.4b" if cuda else "tiny")
    config = OuroConfig() if shape == "1.4b" else tiny_config()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = decode_bench.random_model(config, dtype, args.device)
    replay_model = from_state_dict(
        config, {n: p.detach().clone() for n, p in model.named_parameters()}, device=args.device, dtype=dtype
    )
    replay_model.execution = execution
    num_layers, loops = config.num_hidden_layers, config.total_ut_steps

    llm = LLM(
        model,
        max_num_seqs=1,
        kv_blocks=-(-(args.prompt + args.new_tokens + 1) // 16),
        block_size=16,
        cuda_graphs=False,
        execution=execution,
    )
    prompt = decode_bench.make_prompts(1, args.prompt, config.vocab_size)[0]
    engine_rows: list[torch.Tensor] = []
    engine_taps: dict[str, list] = {name: [] for name in TAPS}
    hooks = record_layers(model, engine_rows, lambda out: out[0, -1])
    hooks += record_sublayers(model, engine_taps, lambda out: out[0, -1])
    out = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=args.new_tokens, max_loops=loops, temperature=1.0, seed=0, ignore_eos=True, logprobs=0
        ),
    )[0]
    for h in hooks:
        h.remove()
    llm.close()
    engine_rows = engine_rows[-num_layers * loops :]  # the last decode step's layer calls, loop-major
    engine_taps = {name: rows[-num_layers * loops :] for name, rows in engine_taps.items()}

    ids = torch.tensor([prompt + out.output_token_ids[:-1]], device=args.device)
    replay_rows: list[torch.Tensor] = []
    replay_taps: dict[str, list] = {name: [] for name in TAPS}
    hooks = record_layers(replay_model, replay_rows, lambda out: out[0, -1])
    hooks += record_sublayers(replay_model, replay_taps, lambda out: out[0, -1])
    backends = {
        "math": "MATH",
        "flash": "FLASH_ATTENTION",
        "efficient": "EFFICIENT_ATTENTION",
        "cudnn": "CUDNN_ATTENTION",
    }
    if args.sdpa == "default":
        ctx = nullcontext()
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel([getattr(SDPBackend, backends[args.sdpa])])
    with torch.no_grad(), ctx:
        logits = replay_model(ids, depths=torch.full_like(ids, loops))
    for h in hooks:
        h.remove()
    replay_lp = float(torch.log_softmax(logits[0, -1].float(), -1)[out.output_token_ids[-1]])

    print(
        f"{shape} {args.dtype} on {args.device}; prompt {args.prompt}, {args.new_tokens} new tokens, K = {loops}; "
        f"engine attention {args.attention}, replay attention {args.replay_attention} "
        f"(SDPA backend {args.sdpa}), projections {args.decode_gemv}"
    )
    picks = sorted({0, 1, num_layers // 2, num_layers - 1})
    print("loop  " + "  ".join(f"layer {i:>2}" for i in picks) + "   max over layers   (relative max |Δ|)")
    for t in range(loops):
        rel = [relative(engine_rows[t * num_layers + i], replay_rows[t * num_layers + i]) for i in range(num_layers)]
        print(f"{t + 1:>4}  " + "  ".join(f"{rel[i]:8.2e}" for i in picks) + f"   {max(rel):8.2e}")
    # inside the first layer call whose output differs: which sublayer's input or output first does
    calls = [(c, relative(engine_rows[c], replay_rows[c])) for c in range(num_layers * loops)]
    first = next((c for c, r in calls if r > 0), None)
    if first is None:
        print("every layer call's output is bitwise the same")
    else:
        steps = [
            (name, relative(engine_taps[name][first], replay_taps[name][first]))
            for name in TAPS
            if len(engine_taps[name]) == len(replay_taps[name]) == num_layers * loops
        ]
        steps.append(("layer out", calls[first][1]))
        print(
            f"first differing layer call: loop {first // num_layers + 1}, layer {first % num_layers}; "
            + ", ".join(f"{name} {r:.2e}" for name, r in steps)
        )
    engine_lp = out.log_probs[-1]
    print(f"last token logprob: engine {engine_lp:.5f}, replay {replay_lp:.5f}, |Δ| {abs(engine_lp - replay_lp):.3g}")
    response = torch.tensor(out.output_token_ids, device=args.device)
    replay_all = token_logprobs(logits[0], response, args.prompt)
    engine_all = torch.tensor(out.log_probs, device=args.device)
    print(
        f"all {len(response)} response tokens, engine vs replay: mean |Δ| "
        f"{(engine_all - replay_all).abs().mean():.4g}, "
        f"max {(engine_all - replay_all).abs().max():.4g}"
    )
    # The replay against itself with a shorter input: same function, other matmul shapes (M). The
    # difference is bf16 rounding noise alone, a floor for any two kernels that are not batch-invariant.
    cut = max(1, len(response) // 2)
    with torch.no_grad(), ctx:
        short = replay_model(ids[:, :-cut], depths=torch.full_like(ids[:, :-cut], loops))
    n = len(response) - cut
    floor = (token_logprobs(short[0], response[:n], args.prompt) - replay_all[:n]).abs()
    print(
        f"replay vs replay of the input {cut} tokens shorter ({n} common tokens): mean |Δ| {floor.mean():.4g}, "
        f"max {floor.max():.4g}"
    )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """Log-probabilities of `tokens` (the response) from replay logits [L, V] of prompt + response[:-1]."""
    scoring = logits[prompt - 1 : prompt - 1 + len(tokens)].float()
    return torch.log_softmax(scoring, -1).gather(1, tokens[:, None]).squeeze(1)


if __name__ == "__main__":
    main()
