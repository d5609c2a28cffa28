"""The engine's scheduler on a rollout's shape, without a model: decode steps, how full they run,
preemptions and recomputed tokens, per admission policy, and what each schedule costs at the
H200's limits.

    python bench/schedule.py                                   # 1,024-token prompts, 32 x 8 x 512, K = 4
    python bench/schedule.py --prompts p100 --varied           # drawn prompts, responses that stop early
    python bench/schedule.py --kv-gib 40 --group 16 --response 4096 --sequences 64

The scheduler is the engine's own (engine/scheduler.py, with its allocator and shared prompt
blocks); only the model is left out. Its policy depends on request order, lengths and free blocks
alone, so for the same lengths and cache this is the schedule the engine makes: each prefill step
admits what `schedule` admits, each decode step appends a token to every sequence it decodes, and
a sequence finishes at its drawn response length. Responses run to `--response` tokens (what a
random model does), or with `--varied` stop after a geometric number of tokens, mean 256 (as
bench/workloads.py's varied-stop model does).

The policies: `fcfs` (the default: admit while blocks are free, preempt the youngest when they
run out, recompute it later) and `reserve` (`LLM(reserve_blocks=True)`: admit only what can grow
to its longest without preempting anyone).

The cost estimate is the bytes roofline of bench/e2e_limits.py step by step (the layer stack K
times, the lm_head, every decoded sequence's K/V in K planes, a shared prompt once per group)
plus every prefill's model FLOPs at full depth at 780 TFLOP/s (recomputes included); it ranks
schedules, it does not predict the engine's seconds. The model is Ouro-1.4B's shape (`--layers
48` for 2.6B's).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from e2e_limits import COPY_BANDWIDTH, TRAIN_FLOPS, layer_stack_params  # noqa: E402
from workloads import STOP_SHARE, prompt_lengths  # noqa: E402

from ouro_cli.engine.contract import SamplingParams  # noqa: E402
from ouro_cli.engine.kv_cache import BlockAllocator, blocks_needed  # noqa: E402
from ouro_cli.engine.scheduler import Scheduler, Sequence  # noqa: E402
from ouro_cli.model.config import OuroConfig  # noqa: E402

GIB = 2**30
BINS = 10  # the decode batch over time: its mean in each tenth of the decode steps


@dataclass
class Outcome:
    policy: str
    decode_steps: int
    prefill_steps: int
    preemptions: int
    recomputed_tokens: int
    batches: list[int]  # the decode batch of every decode step
    decode_bytes: float
    prefill_tokens: int

    def seconds(self, config: OuroConfig) -> float:
        flops = 2 * config.num_loops * layer_stack_params(config) * self.prefill_tokens
        return self.decode_bytes / COPY_BANDWIDTH + flops / TRAIN_FLOPS

    def over_time(self) -> list[float]:
        n = len(self.batches)
        edges = [round(i * n / BINS) for i in range(BINS + 1)]
        return [sum(self.batches[a:b]) / max(b - a, 1) for a, b in itertools.pairwise(edges)]


def simulate(
    prompts: list[int],
    responses: list[int],
    group: int,
    kv_blocks: int,
    block_size: int,
    max_num_seqs: int,
    config: OuroConfig,
    k: int,
    *,
    reserve: bool,
    share: bool = True,
) -> Outcome:
    """Run the engine's scheduler over one call: sample i has prompt prompts[i // group] and
    stops after responses[i] tokens."""
    allocator = BlockAllocator(kv_blocks)
    sched = Scheduler(allocator, block_size, max_num_seqs, 8192, reserve=reserve)
    plane = 2 * config.num_hidden_layers * config.num_key_value_heads * config.dim_per_head * 2  # bf16 K+V
    weights = (k * layer_stack_params(config) + config.vocab_size * config.hidden_size) * 2
    seqs = []
    for i, n in enumerate(responses):
        prompt = [1] * prompts[i // group]
        params = SamplingParams(max_tokens=n, ignore_eos=True, max_loops=k)
        seq = Sequence(i, str(i), prompt, params, None, len(prompt) + n - 1, group=i // group if share else None)
        seqs.append(seq)
        sched.add(seq)
    out = Outcome("reserve" if reserve else "fcfs", 0, 0, 0, 0, [], 0.0, 0)
    while sched.has_work():
        plan = sched.schedule()
        out.preemptions += len(plan.preempted)
        for seq in plan.prefill:  # prefill computes the prompt (and recomputes what was generated)
            seq.num_cached = len(seq.prefill_tokens)
            if seq.prompt_donor is None:
                out.prefill_tokens += seq.num_cached
            out.recomputed_tokens += max(len(seq.output) - 1, 0)
            seq.prompt_donor = None
            if seq.is_fresh:
                seq.output.append(0)  # token 0 comes from the prefill's logits
        if plan.prefill:
            out.prefill_steps += 1
        decoded = [s for s in plan.decode if s not in plan.prefill]
        if decoded:
            out.decode_steps += 1
            out.batches.append(len(decoded))
            context = sum(s.num_cached for s in decoded)
            if share:  # a group's full prompt blocks read once per step
                by_group: dict[int, list[Sequence]] = {}
                for s in decoded:
                    by_group.setdefault(s.group, []).append(s)
                for members in by_group.values():
                    full = len(members[0].prompt) // block_size * block_size
                    context -= (len(members) - 1) * full
            out.decode_bytes += weights + context * k * plane
        for seq in decoded:
            seq.num_cached += 1
            seq.output.append(0)
        for seq in [*plan.prefill, *decoded]:
            if len(seq.output) >= seq.params.max_tokens and seq in sched.running:
                sched.finish(seq)
    assert all(len(s.output) == n for s, n in zip(seqs, responses, strict=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="p1024", help="prompt lengths: p100 (drawn) or pN (default p1024)")
    parser.add_argument("--sequences", type=int, default=256, help="samples in the call (default 256)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--response", type=int, default=512, help="most response tokens (default 512)")
    parser.add_argument("--varied", action="store_true", help="responses stop early (mean 256 tokens)")
    parser.add_argument("--k", type=int, default=4, help="loops per decoded token (default 4)")
    parser.add_argument("--kv-gib", type=float, default=100.0, help="the KV cache in GiB (default 100)")
    parser.add_argument("--layers", type=int, default=24, help="24: Ouro-1.4B; 48: 2.6B")
    parser.add_argument("--no-share", action="store_true", help="every sample its own prompt copy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = OuroConfig(num_hidden_layers=args.layers)
    block_size = 16
    token_bytes = args.k * 2 * config.num_hidden_layers * config.num_key_value_heads * config.dim_per_head * 2
    kv_blocks = int(args.kv_gib * GIB // (token_bytes * block_size))
    g = random.Random(args.seed)
    prompts = prompt_lengths(args.prompts, -(-args.sequences // args.group), seed=args.seed)
    if args.varied:  # each token stops with probability 1 / STOP_SHARE
        responses = [min(args.response, 1 + int(g.expovariate(1 / STOP_SHARE))) for _ in range(args.sequences)]
    else:
        responses = [args.response] * args.sequences
    whole = sum(
        blocks_needed(prompts[i // args.group] + n + 1, block_size) for i, n in enumerate(responses)
    )  # every sequence at its longest, prompts copied
    print(
        f"{args.sequences} samples ({args.group} a prompt, prompts {args.prompts}, responses "
        f"{'varied, mean ' + str(sum(responses) // len(responses)) if args.varied else args.response}), "
        f"K = {args.k}, {config.num_hidden_layers} layers; cache {args.kv_gib:.0f} GiB = {kv_blocks} blocks of "
        f"{block_size} at K planes ({kv_blocks / whole:.2f} of every sample at its longest with private prompts)"
    )
    head = f"{'policy':<8} {'decode steps':>12} {'mean batch':>10} {'preempted':>9} {'recomputed':>10} {'est. s':>7}"
    head += "  batch over time"
    print(head)
    print("-" * len(head))
    for reserve in (False, True):
        o = simulate(
            prompts,
            responses,
            args.group,
            kv_blocks,
            block_size,
            args.sequences,
            config,
            args.k,
            reserve=reserve,
            share=not args.no_share,
        )
        mean = sum(o.batches) / max(len(o.batches), 1)
        print(
            f"{o.policy:<8} {o.decode_steps:>12} {mean:>10.1f} {o.preemptions:>9} {o.recomputed_tokens:>10} "
            f"{o.seconds(config):>7.1f}  {' '.join(f'{b:.0f}' for b in o.over_time())}"
        )


if __name__ == "__main__":
    main()
