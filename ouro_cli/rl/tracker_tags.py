"""What a tracker calls each figure of a metrics line, and which figures it leaves out.

Every scalar goes under one of six groups, so that TensorBoard and W&B show a section per
stage instead of a hundred flat tags:

- `reward/`: the reward (`reward/mean`, and per decode budget `reward/mean/K=3`);
- `eval/`: the held-out evaluations (`eval/accuracy/K=4`, `eval/pass@2/K=4`, ...);
- `rollout/`: what the update sampled and how the engine ran (`rollout/mean_exit_depth`,
  `rollout/truncations`, `rollout/engine_decode_tokens`, the `rollout/exit_depth` histogram);
- `train/`: the trainer's figures (`train/loss`, `train/grad_norm`, `train/lr`), and the
  engine-trainer log-probability mismatch (`train/logprob_mismatch_mean`, per K and per depth);
- `timing/`: seconds and other durations (`timing/rollout_s`, `timing/train_forward_backward_s`,
  `timing/engine_prefill_us`, `timing/device_hours`);
- `memory/`: peak and held device memory per phase, the memory outside PyTorch, the CUDA-graph
  pools, and allocation retries.

A field keeps its metrics.jsonl name under its group, less the group's own prefix
(`train_loss` -> `train/loss`, `reward_mean` -> `reward/mean`), so a tag leads back to its
field. Left out are the fields that are not measurements of the update (its number, the
weight version, the number of ranks), the trainer's copy of the mismatch (the same figure as
`logprob_mismatch_*`), and the *structural zeros*: counters that the run's configuration
keeps at zero on every update (`STRUCTURAL_ZEROS`, each with the configuration that zeroes
it), such as the speculation counters without `--speculative-tokens`. A figure that is zero
only so far (truncations, preemptions, the save time of an update without a save) is logged.
metrics.jsonl keeps every field either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

GROUPS = ("reward", "eval", "rollout", "train", "timing", "memory")

NOT_LOGGED = frozenset(
    {
        "update",  # the step itself
        "weight_version",  # update + 1
        "ranks",
        "plan_agreed_ranks",
        "params_identical_across_ranks",  # a run whose ranks disagree stops
        "train_logprob_mismatch_mean",  # logprob_mismatch_mean
        "train_logprob_mismatch_max",  # logprob_mismatch_max
    }
)


def group_of(field: str) -> str:
    """The group of a metrics field (module docstring)."""
    if field.endswith(("_gib", "_alloc_retries")):
        return "memory"
    if field.endswith(("_s", "_us", "_ms")) or field == "device_hours":
        return "timing"
    if field.startswith("reward"):
        return "reward"
    if field.startswith(("train_", "logprob_mismatch")):
        return "train"
    if field.startswith("eval"):
        return "eval"
    return "rollout"


def tag(key: str) -> str:
    """The tracker's name for a figure: `field[/part]` -> `group/name[/part]`, e.g.
    `reward_mean/K=3` -> `reward/mean/K=3`; a held-out figure (`eval/...`) keeps its name."""
    field, slash, part = key.partition("/")
    group = group_of(field)
    if group == "eval":
        return key
    return f"{group}/{field.removeprefix(group + '_')}{slash}{part}"


@dataclass(frozen=True)
class StructuralZero:
    """Fields (shell patterns) that stay zero on every update of a run whose options `applies`."""

    fields: tuple[str, ...]
    when: str  # the configuration, as the docs say it
    applies: Callable[[Any, str], bool]  # (TrainOptions, device type) -> bool


STRUCTURAL_ZEROS = (
    StructuralZero(("engine_spec_*",), "without --speculative-tokens", lambda o, d: not o.engine.speculative_tokens),
    StructuralZero(
        (
            "engine_*graph*",  # CUDA graph captures and replays
            "engine_decode_*_gpu_us",  # CUDA event timings
            "engine_decode_steps_overlapped",  # decode overlap runs on CUDA
            "engine_decode_rows_discarded",
        ),
        "off CUDA",
        lambda o, d: d != "cuda",
    ),
    StructuralZero(
        ("compile_s", "*_compile_s"),
        "when nothing compiles (--compile off, or auto off CUDA)",
        lambda o, d: not o.execution.compiles_gradients(d),
    ),
    StructuralZero(
        ("groups_filtered", "refill_rounds", "refill_exhausted", "refill_s"),
        "without --filter-groups",
        lambda o, d: not o.filter_groups,
    ),
    StructuralZero(("train_overlong_masked",), "unless --overlong mask", lambda o, d: o.overlong != "mask"),
    StructuralZero(
        ("train_is_masked_fraction",),
        "unless --is-correction mis or geo-mask",
        lambda o, d: o.trainer.is_correction not in ("mis", "geo-mask"),
    ),
)


def left_out(options: Any, device_type: str) -> Callable[[str], bool]:
    """Whether a metrics field is left out of the trackers of a run with these options on a
    device of `device_type` (cpu, cuda)."""
    zeros = [p for z in STRUCTURAL_ZEROS if z.applies(options, device_type) for p in z.fields]

    def skipped(field: str) -> bool:
        return field in NOT_LOGGED or any(fnmatchcase(field, p) for p in zeros)

    return skipped


__all__ = ["GROUPS", "NOT_LOGGED", "STRUCTURAL_ZEROS", "StructuralZero", "group_of", "left_out", "tag"]
