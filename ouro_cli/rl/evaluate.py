"""Held-out evaluation: accuracy per decode budget K, with mean exit depth and tokens.

N samples per prompt (`samples`, default 1) at the given temperature. The seed of sample s
of the prompt at position i derives from the run seed, i and s only (`eval_seed`), so two
evaluations of different policies on the same prompts are paired (the difference is the
policy, not the dice). Sample 0 keeps the seed a one-sample evaluation gives its prompt,
and sample s the same seed whatever N, so N = 1 is the one-sample evaluation exactly and a
larger N extends a smaller one.

Per K, `accuracy` is the mean reward over every prompt and sample (avg@N). With N > 1 the
result also names N (`samples`), repeats it as `avg@N`, and gives the unbiased pass@k for
k = 1, 2, 4, … up to N (`pass_at_k`, averaged over prompts), where a sample passes when its
reward is positive; for 0/1 rewards pass@1 equals avg@N. A one-sample result keeps exactly
the fields it always had.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .data import Row
from .rewards.grading import Grader
from .rollout import RolloutSample, RolloutSampling, generate_groups, request_seed


def eval_seed(seed: int, prompt: int, sample: int) -> int:
    """The seed of sample `sample` of the prompt at position `prompt`: the rollout seed of
    purpose "eval" with the sample in the update's place (sample 0: the one-sample seed)."""
    return request_seed(seed, sample, prompt, "eval")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` samples of which `c` passed: the chance that
    k of them drawn without replacement hold a passing one, 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), the same ratio with every factor in [0, 1),
    so no binomial coefficient is formed and nothing overflows for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a passing sample
        return 1.0
    missed = 1.0
    for i in range(n - c + 1, n + 1):
        missed *= 1.0 - k / i
    return 1.0 - missed


def pass_ks(samples: int) -> list[int]:
    """The k reported with `samples` samples per prompt: 1, 2, 4, … up to `samples`."""
    ks, k = [], 1
    while k <= samples:
        ks.append(k)
        k *= 2
    return ks


def evaluate(
    engine,
    rows: Sequence[Row],
    prompt_ids: Sequence[list[int]],
    sampling: RolloutSampling,
    *,
    ks: Sequence[int],
    reward_fn: Grader | Callable[[str, Any, Any], float],
    samples: int = 1,
    responses: list[dict[str, Any]] | None = None,
    where: str = "evaluation",
) -> list[dict[str, Any]]:
    """Accuracy (avg@N), mean exit depth and tokens per K of `ks` with `samples` samples per
    prompt, and pass@k when `samples` > 1 (module docstring). `responses`, when given, gets
    one record per (K, prompt, sample) in that order (`response_record`). A reward that is
    not a finite real number is a CheckFailed whose line begins with `where` and K
    (rewards/grading.py)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    grade = Grader.of(reward_fn)
    seeds = [eval_seed(sampling.seed, i, s) for i in range(len(rows)) for s in range(samples)]
    results = []
    for k in ks:
        drawn = generate_groups(
            engine, rows, prompt_ids, sampling, group_size=samples, k=k, update=0, purpose="eval", seeds=seeds
        )
        rewards = [
            grade(s.text, s.row.label, s.row.metadata, problem_id=s.row.problem_id, where=f"{where}, K={k}")
            for s in drawn
        ]
        decode_depths = [d for s in drawn for d in s.exit_depths[1:]]
        result = {
            "k": k,
            "prompts": len(rows),
            "accuracy": sum(rewards) / len(rewards),
            "mean_exit_depth": sum(decode_depths) / len(decode_depths) if decode_depths else float(sampling.num_loops),
            "mean_tokens": sum(len(s.response_ids) for s in drawn) / len(drawn),
            "truncated": sum(s.finish_reason == "length" for s in drawn),
        }
        if samples > 1:
            passed = [sum(r > 0 for r in rewards[i * samples : (i + 1) * samples]) for i in range(len(rows))]
            result.update({"samples": samples, f"avg@{samples}": result["accuracy"]})
            result.update(
                {f"pass@{j}": sum(pass_at_k(samples, c, j) for c in passed) / len(rows) for j in pass_ks(samples)}
            )
        results.append(result)
        if responses is not None:
            responses.extend(
                response_record(s, i % samples, r) for i, (s, r) in enumerate(zip(drawn, rewards, strict=True))
            )
    return results


def response_record(sample: RolloutSample, index: int, reward: float) -> dict[str, Any]:
    """One line of responses.jsonl: which prompt (and its label), K and sample, the text, its
    reward, and how it ran (mean decode exit depth, None when only the prefill's token was
    produced)."""
    depths = sample.exit_depths[1:]
    return {
        "problem_id": sample.prompt_id,
        "label": sample.row.label,
        "k": sample.k,
        "sample": index,
        "seed": sample.seed,
        "text": sample.text,
        "reward": reward,
        "mean_exit_depth": sum(depths) / len(depths) if depths else None,
        "tokens": len(sample.response_ids),
        "truncated": sample.finish_reason == "length",
    }


def run_eval(options, *, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """`ouro eval`: the held-out accuracy per K of one checkpoint (HF, Megatron or a run
    directory) with `options.samples` samples per prompt, written to `options.out`
    (evaluations.jsonl, responses.jsonl, manifest, COMPLETE) through the output guard
    (ouro_cli/outputs.py): OUT is checked before the model loads and again once the
    checkpoint's files are known, stays locked while the evaluation runs, and appears whole or
    not at all. Returns the result document (`out`, `evaluations`, the path of `responses`,
    and the `note` that an unfinished run was read at its latest complete checkpoint)."""
    import time
    from pathlib import Path

    from ouro_cli import outputs

    from .data import columns_for, load_dataset
    from .rewards import check_labels, load_reward

    rows = load_dataset(options.data, columns_for(options))[: options.prompts]
    reward_fn = load_reward(options.task.reward_function)
    check_labels(reward_fn, options.task.reward_function, [(f"{options.data}:{r.line}", r.label) for r in rows])
    grader = Grader(reward_fn, options.task.reward_function, options.task.reward_timeout)
    target = Path(options.out or f"evals/ouro-eval-{time.strftime('%Y%m%d-%H%M%S')}")
    with outputs.claimed_output(
        target, overwrite=options.overwrite, command="ouro eval", inputs=[options.data]
    ) as output:
        return _run_eval(options, rows, grader, output, log)


def _run_eval(options, rows: list[Row], grader: Callable, output, log: Callable[[str], None]) -> dict[str, Any]:
    """`run_eval` once OUT is claimed: load the checkpoint, evaluate, publish OUT."""
    import time
    from pathlib import Path

    import torch

    from ouro_cli import artifacts
    from ouro_cli.checkpoint import open_checkpoint
    from ouro_cli.checkpoint.sources import unfinished_run_note
    from ouro_cli.engine import LLM
    from ouro_cli.engine.tokenizer import TextCodec
    from ouro_cli.errors import UserError
    from ouro_cli.mcore import single_process_group
    from ouro_cli.model import from_state_dict

    from .metrics import append_jsonl, write_jsonl
    from .prompts import stop_tokens_for, tokenize_prompts
    from .schedule import validate_depths, validate_min_loops
    from .template import template_for_checkpoint

    target = output.path
    device = ("cuda" if torch.cuda.is_available() else "cpu") if options.device == "auto" else options.device
    with single_process_group():
        source = open_checkpoint(options.model)  # a training run's iteration is pinned until `release`
        output.check([options.data, *source.input_paths])
        note = unfinished_run_note(options.model, source)
        if note:
            log(f"note: {note}")
        ks = validate_depths(options.depths, source.config.num_loops)
        validate_min_loops(options.sampling.min_loops, source.config.num_loops)
        codec = TextCodec.from_dir(source.assets_dir)
        if codec is None:
            raise UserError(f"{options.model} has no tokenizer.json")
        template = template_for_checkpoint(options.task.prompt_template, source.assets_dir)
        prompt_ids = tokenize_prompts(
            codec,
            template,
            rows,
            source.config.max_position_embeddings,
            options.sampling.max_response_len,
            options.data,
        )
        net = from_state_dict(source.config, dict(source.iter_tensors()), device=device)
        source.release()
    sampling = RolloutSampling.of(
        options.sampling,
        num_loops=source.config.num_loops,
        seed=options.seed,
        stop_token_ids=stop_tokens_for(source.config, codec),
        decode=codec.decode,
    )
    engine = LLM(net, max_num_seqs=options.max_num_seqs, execution=options.execution)
    start = time.perf_counter()
    responses: list[dict[str, Any]] = []
    try:
        results = evaluate(
            engine, rows, prompt_ids, sampling, ks=ks, reward_fn=grader, samples=options.samples, responses=responses
        )
    finally:
        engine.close()
    with output.staged() as staging:
        from ouro_cli.warnings_log import attach_active

        attach_active(staging / "logs" / "warnings.log", shown=target / "logs" / "warnings.log")
        for r in results:
            append_jsonl(staging / "evaluations.jsonl", {"model": str(options.model), **r})
        write_jsonl(staging / "responses.jsonl", responses)
        artifacts.write_manifest(
            staging,
            "ouro eval",
            {**options.to_dict(), "depths": ks, "device": device, "execution": options.execution.effective(device)},
            [Path(options.data)],
        )
        artifacts.mark_complete(staging)
    return {
        "out": str(target),
        "evaluations": results,
        "responses": str(target / "responses.jsonl"),
        "seconds": time.perf_counter() - start,
        **({"note": note} if note else {}),
    }
