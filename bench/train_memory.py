"""Activation memory of the trainer's replay per token, measured against the sizing model.

    python bench/train_memory.py                       # 1.4B shape on CUDA: recompute off and on
    python bench/train_memory.py --shape tiny --device cpu
    python bench/train_memory.py --exact               # exact mode's replay (docs/exact.md)

For each recompute mode it runs forward + backward (`Trainer.forward_backward`, one
micro-batch, full depth T) on random samples of `--rows` x `--length` tokens and prints the
peak device memory above the trainer's resident state, per token, next to
`ouro_cli.rl.sizing.activation_bytes_per_token` (the figure `ouro train` sizes its
micro-batches with). A ratio above 1 means the sizing model under-counts and a full
micro-batch could run out of memory; well below 1, micro-batches are smaller than they
could be. CPU has no per-phase peak counter: the CPU run only checks the path.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["1.4b", "tiny"], default="1.4b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024, help="tokens per sample (prompt 1/4, response 3/4)")
    parser.add_argument("--exact", action="store_true", help="the replay in exact mode (`ouro train --exact`)")
    args = parser.parse_args()

    import torch
    from train_step import build_trainer, make_samples, model_config

    from ouro_cli.rl import sizing

    config = model_config(args.shape)
    results = []
    for recompute in (False, True):
        trainer, _ = build_trainer(args.shape, args.device, recompute=recompute, exact=args.exact)
        dtype = trainer.config.torch_dtype
        prompt = args.length // 4
        samples = make_samples(config, args.rows, prompt, args.length - prompt, "full", random.Random(0))
        trainer.train_step(samples)  # warm-up: compiles, creates Adam state
        cuda = trainer.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        trainer.forward_backward(samples)
        tokens = args.rows * args.length
        estimate = sizing.activation_bytes_per_token(config, dtype, recompute, args.length, args.exact)
        row = {"exact": args.exact, "recompute": recompute, "tokens": tokens, "estimate_bytes_per_token": estimate}
        if cuda:
            torch.cuda.synchronize()
            measured = (torch.cuda.max_memory_allocated() - base) / tokens
            row.update(
                measured_bytes_per_token=round(measured),
                ratio=round(measured / estimate, 3),
                resident_gib=round(base / 2**30, 2),
            )
        results.append(row)
        trainer.close()
        del trainer
        if cuda:
            torch.cuda.empty_cache()
    for r in results:
        measured = r.get("measured_bytes_per_token")
        print(
            f"recompute {'on ' if r['recompute'] else 'off'}: {r['tokens']} tokens, estimate "
            f"{r['estimate_bytes_per_token'] / 2**20:.2f} MiB/token"
            + (f", measured {measured / 2**20:.2f} MiB/token, ratio {r['ratio']:.2f}" if measured else "")
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
