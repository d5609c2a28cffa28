"""Held-out evaluation: accuracy per decode budget K, with mean exit depth and tokens.

One sample per prompt at the given temperature, with seeds derived from the run seed
and the prompt's position only, so two evaluations of different policies on the same
prompts are paired (the difference is the policy, not the dice).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .data import Row
from .rollout import RolloutSampling, generate_groups


def evaluate(engine, rows: Sequence[Row], prompt_ids: Sequence[list[int]], sampling: RolloutSampling, *,
             ks: Sequence[int], reward_fn: Callable[[str, Any, Any], float]) -> list[dict[str, Any]]:
    """Accuracy, mean exit depth and tokens per K of `ks`, one sample per prompt."""
    results = []
    for k in ks:
        samples = generate_groups(engine, rows, prompt_ids, sampling, group_size=1, k=k, update=0, purpose="eval")
        rewards = [float(reward_fn(s.text, s.row.label, s.row.metadata)) for s in samples]
        decode_depths = [d for s in samples for d in s.exit_depths[1:]]
        results.append({
            "k": k,
            "prompts": len(samples),
            "accuracy": sum(rewards) / len(rewards),
            "mean_exit_depth": sum(decode_depths) / len(decode_depths) if decode_depths else float(sampling.num_loops),
            "mean_tokens": sum(len(s.response_ids) for s in samples) / len(samples),
            "truncated": sum(s.finish_reason == "length" for s in samples),
        })
    return results


def run_eval(options, *, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """`ouro eval`: the held-out accuracy per K of one checkpoint (HF, Megatron or a run
    directory), written to `options.out` (evaluations.jsonl, manifest, COMPLETE) through a
    staged output. Inputs are checked before the model loads; returns the result document
    (`out`, `evaluations`, and the `note` that an unfinished run was read at its latest
    complete checkpoint)."""
    import time
    from pathlib import Path

    from ouro_cli import artifacts
    from ouro_cli.errors import UserError

    from .data import columns_for, load_dataset
    from .rewards import check_labels, load_reward

    rows = load_dataset(options.data, columns_for(options))[:options.prompts]
    reward_fn = load_reward(options.task.reward_function)
    check_labels(reward_fn, options.task.reward_function, [(f"{options.data}:{r.line}", r.label) for r in rows])
    target = Path(options.out or f"evals/ouro-eval-{time.strftime('%Y%m%d-%H%M%S')}")
    artifacts.check_output_dir(target, options.overwrite, inputs=[options.data])

    import torch

    from ouro_cli.checkpoint import open_checkpoint
    from ouro_cli.checkpoint.sources import unfinished_run_note
    from ouro_cli.engine import LLM
    from ouro_cli.engine.tokenizer import TextCodec
    from ouro_cli.mcore import single_process_group
    from ouro_cli.model import from_state_dict

    from .metrics import append_jsonl
    from .prompts import stop_tokens_for, tokenize_prompts
    from .schedule import validate_depths
    from .template import template_for_checkpoint

    device = ("cuda" if torch.cuda.is_available() else "cpu") if options.device == "auto" else options.device
    with single_process_group():
        source = open_checkpoint(options.model)
        inputs = [options.data, *source.input_paths]
        artifacts.check_output_dir(target, options.overwrite, inputs=inputs)
        note = unfinished_run_note(options.model)
        if note:
            log(f"note: {note}")
        ks = validate_depths(options.depths, source.config.num_loops)
        codec = TextCodec.from_dir(source.assets_dir)
        if codec is None:
            raise UserError(f"{options.model} has no tokenizer.json")
        template = template_for_checkpoint(options.task.prompt_template, source.assets_dir)
        prompt_ids = tokenize_prompts(codec, template, rows, source.config.max_position_embeddings,
                                      options.sampling.max_response_len, options.data)
        net = from_state_dict(source.config, dict(source.iter_tensors()), device=device)
    sampling = RolloutSampling.of(options.sampling, num_loops=source.config.num_loops, seed=options.seed,
                                  stop_token_ids=stop_tokens_for(source.config, codec), decode=codec.decode)
    engine = LLM(net, max_num_seqs=options.max_num_seqs, execution=options.execution)
    start = time.perf_counter()
    try:
        results = evaluate(engine, rows, prompt_ids, sampling, ks=ks, reward_fn=reward_fn)
    finally:
        engine.close()
    with artifacts.staged_output(target, overwrite=options.overwrite, inputs=inputs) as staging:
        from ouro_cli.warnings_log import attach_active

        attach_active(staging / "logs" / "warnings.log", shown=target / "logs" / "warnings.log")
        for r in results:
            append_jsonl(staging / "evaluations.jsonl", {"model": str(options.model), **r})
        artifacts.write_manifest(staging, "ouro eval", {**options.to_dict(), "depths": ks, "device": device,
                                                        "execution": options.execution.effective(device)},
                                 [Path(options.data)])
        artifacts.mark_complete(staging)
    return {"out": str(target), "evaluations": results, "seconds": time.perf_counter() - start,
            **({"note": note} if note else {})}
