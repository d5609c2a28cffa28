"""Experiment trackers beside metrics.jsonl: `--logger tensorboard` and `--logger wandb`.

metrics.jsonl stays the source of truth; a tracker gets the same figures, with the update
as its step, each named by tracker_tags.py under one of the groups `reward/`, `eval/`,
`rollout/`, `train/`, `timing/` and `memory/`:
- every numeric field of the update's metrics line (`reward/mean`, `train/grad_norm`,
  `timing/rollout_s`, `memory/peak_memory_train_gib`, ...), and the reward, the mismatch and
  the exit depth again per decode budget (`reward/mean/K=3`), so each K is one curve, and the
  mismatch per exit depth (`train/logprob_mismatch_mean/depth=2`); under loop weighting, the
  mean log-probability of the sampled tokens per loop (`train/loop_logprob_mean/t=2`,
  docs/grpo.md §5); not the fields that are not measurements, nor the counters the run's
  configuration keeps at zero (tracker_tags.py);
- the decoded tokens' exit depths as a histogram (`rollout/exit_depth`);
- every held-out evaluation as `eval/accuracy/K=k`, `eval/mean_exit_depth/K=k` and
  `eval/mean_tokens/K=k`, and with `--eval-samples N` > 1 its pass@k as `eval/pass@k/K=k`
  (accuracy is then avg@N).

TensorBoard writes event files into `RUN/logs/tensorboard/` (torch's SummaryWriter); a resumed
run purges the steps from its checkpoint's update on, which it logs again. Weights & Biases
(the optional extra `wandb`) honours its own environment, `WANDB_MODE=offline` included, keeps
its files in `RUN/logs/`, and files the run under `--wandb-project`, `--wandb-entity`,
`--wandb-name` and `--wandb-tag`. The W&B run id is drawn when the run starts and kept in
`RUN/logs/wandb_id`; `ouro resume` continues that W&B run (`resume="allow"`), so one run
directory is one W&B run. Its x-axis is the `update` field logged with every row (W&B's
`step_metric`), not W&B's own step, which a resumed run cannot rewind: the updates a
resume runs again, from its checkpoint's on, are logged under their own update numbers.
Only rank 0 logs.
"""

from __future__ import annotations

import numbers
import secrets
from collections.abc import Callable
from typing import Any

from ouro_cli.errors import UserError

from .run_dir import RunDir
from .tracker_tags import left_out, tag

LOGGERS = ("tensorboard", "wandb")
EXIT_DEPTH = tag("exit_depth")  # the histogram's name
STEP = "update"  # W&B's x-axis (its step_metric)


def check_loggers(names: list[str]) -> None:
    for name in names:
        if name not in LOGGERS:
            raise UserError(f"--logger must be one of {', '.join(LOGGERS)}, got {name!r}")
    if "wandb" in names:
        try:
            import wandb  # noqa: F401
        except ImportError as err:
            raise UserError("--logger wandb needs Weights & Biases: pip install 'ouro-cli[wandb]'") from err
    if "tensorboard" in names:
        try:
            import tensorboard  # noqa: F401
        except ImportError as err:  # pragma: no cover - a declared dependency
            raise UserError("--logger tensorboard needs the tensorboard package: pip install tensorboard") from err


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics line, plus the reward, mismatch and exit depth per K, the
    mismatch per exit depth and the per-loop log-probabilities, by metrics name (`reward_mean/K=3`)."""
    out = {key: float(value) for key, value in record.items() if isinstance(value, numbers.Real) and key != "update"}
    k = record.get("k")
    for key in ("reward_mean", "logprob_mismatch_mean", "mean_exit_depth"):
        if k is not None and isinstance(record.get(key), numbers.Real):
            out[f"{key}/K={k}"] = float(record[key])
    for t, value in enumerate(record.get("train_loop_logprob_mean") or [], start=1):
        if isinstance(value, numbers.Real):
            out[f"train_loop_logprob_mean/t={t}"] = float(value)
    for key in ("logprob_mismatch_mean", "logprob_mismatch_max"):  # and by exit depth
        for depth, value in (record.get(f"{key}_by_depth") or {}).items():
            out[f"{key}/depth={depth}"] = float(value)
    return out


def exit_depths(record: dict[str, Any]) -> list[int]:
    """The decoded tokens' exit depths of an update, from its histogram."""
    return [int(d) for d, n in record.get("exit_depth_histogram", {}).items() for _ in range(int(n))]


WANDB_ID_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


def wandb_run_id(run: RunDir, *, resume: bool) -> str:
    """The W&B run id of the run directory: the one kept in RUN/logs/wandb_id when resuming,
    else a new one, written there before W&B starts."""
    if resume and run.wandb_id.is_file():
        return run.wandb_id.read_text().strip()
    new = "".join(secrets.choice(WANDB_ID_CHARS) for _ in range(8))
    run.wandb_id.parent.mkdir(parents=True, exist_ok=True)
    run.wandb_id.write_text(new + "\n")
    return new


class Trackers:
    """The trackers a run logs to (none: every call is a no-op)."""

    def __init__(
        self, tensorboard: Any = None, wandb_run: Any = None, skipped: Callable[[str], bool] | None = None
    ) -> None:
        self._tb, self._wandb = tensorboard, wandb_run
        self._skipped = skipped or (lambda field: False)  # metrics fields left out (tracker_tags.left_out)

    @classmethod
    def open(cls, options: Any, run: RunDir, *, start_update: int, resume: bool) -> Trackers:
        """The trackers `options.loggers` names, for a run that starts (or resumes) at `start_update`."""
        names = options.loggers
        check_loggers(names)
        tensorboard = wandb_run = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            # a resume logs the updates from its checkpoint's on again: TensorBoard hides the old ones
            purge = start_update if resume else None
            tensorboard = SummaryWriter(log_dir=str(run.tensorboard), purge_step=purge)
        if "wandb" in names:
            import wandb

            w = options.wandb
            wandb_run = wandb.init(
                project=w.wandb_project or "ouro",
                entity=w.wandb_entity,
                name=w.wandb_name or run.root.name,
                tags=w.wandb_tags or None,
                id=wandb_run_id(run, resume=resume),
                resume="allow",
                dir=str(run.wandb_id.parent),
                config=options.to_dict(),
                allow_val_change=True,  # a resume may change --updates and the other free options
                reinit="finish_previous",
            )
            wandb_run.define_metric(STEP)
            wandb_run.define_metric("*", step_metric=STEP)
        return cls(tensorboard, wandb_run, left_out(options, options.trainer.resolved_device))

    def update(self, record: dict[str, Any]) -> None:
        step, depths = int(record["update"]), exit_depths(record)
        values = {tag(k): v for k, v in scalars(record).items() if not self._skipped(k.partition("/")[0])}
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
            if depths:
                import torch

                self._tb.add_histogram(EXIT_DEPTH, torch.tensor(depths), step, bins="auto")
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            logged: dict[str, Any] = dict(values)
            if depths:
                logged[EXIT_DEPTH] = wandb.Histogram(depths)
            self._wandb.log({**logged, STEP: step})

    def evaluations(self, update: int, results: list[dict[str, Any]]) -> None:
        if not results:
            return
        values = {
            f"eval/{key}/K={r['k']}": float(r[key])
            for r in results
            for key in ("accuracy", "mean_exit_depth", "mean_tokens", *(x for x in r if x.startswith("pass@")))
        }
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, update)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({**values, STEP: update})

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
