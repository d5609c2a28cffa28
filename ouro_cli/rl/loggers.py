"""Experiment trackers beside metrics.jsonl: `--logger tensorboard` and `--logger wandb`.

metrics.jsonl stays the source of truth; a tracker gets the same figures, with the update
as its step:
- every numeric field of the update's metrics line, under its own name (`reward_mean`,
  `train_grad_norm`, `rollout_s`, `logprob_mismatch_mean`, `peak_memory_train_gib`, ...),
  and the reward and mismatch again per decode budget (`reward_mean/K=3`), so each K is
  one curve, and the mismatch per exit depth (`logprob_mismatch_mean/depth=2`); under loop
  weighting, the mean log-probability of the sampled tokens per loop
  (`train_loop_logprob_mean/t=2`, docs/grpo.md §5);
- the decoded tokens' exit depths as a histogram (`exit_depth`);
- every held-out evaluation as `eval/accuracy/K=k`, `eval/mean_exit_depth/K=k` and
  `eval/mean_tokens/K=k`, and with `--eval-samples N` > 1 its pass@k as `eval/pass@k/K=k`
  (accuracy is then avg@N).

TensorBoard writes event files into `RUN/logs/tensorboard/` (torch's SummaryWriter).
Weights & Biases (the optional extra `wandb`) honours its own environment, `WANDB_MODE=offline`
included, and keeps its files in `RUN/logs/`. Only rank 0 logs.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

from ouro_cli.errors import UserError

LOGGERS = ("tensorboard", "wandb")


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
    """The numeric fields of a metrics line, plus the reward and mismatch per K."""
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


class Trackers:
    """The trackers a run logs to (none: every call is a no-op)."""

    def __init__(self, names: list[str], logs_dir: Path, config: dict[str, Any], run_name: str) -> None:
        check_loggers(names)
        self._tb = self._wandb = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(logs_dir) / "tensorboard"))
        if "wandb" in names:
            import wandb

            Path(logs_dir).mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project="ouro", name=run_name, dir=str(logs_dir), config=config, reinit="finish_previous"
            )

    def update(self, record: dict[str, Any]) -> None:
        step, values, depths = int(record["update"]), scalars(record), exit_depths(record)
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
            if depths:
                import torch

                self._tb.add_histogram("exit_depth", torch.tensor(depths), step, bins="auto")
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            logged: dict[str, Any] = dict(values)
            if depths:
                logged["exit_depth"] = wandb.Histogram(depths)
            self._wandb.log(logged, step=step)

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
            self._wandb.log(values, step=update)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
