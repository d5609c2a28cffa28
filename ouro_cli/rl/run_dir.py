"""The one place that knows the run directory layout; every command asks it.

    RUN/
      ouro-plan.json         the run's contract and `next_update`; rewritten with each checkpoint
      manifest.json          how the run was started (command, options, inputs, versions)
      checkpoint/            Megatron checkpoint (see ouro_cli/checkpoint/layout.py)
      metrics.jsonl          one JSON line per update
      evaluations.jsonl      held-out accuracy per K, one line per (update, K)
      responses.jsonl        every held-out response of those evaluations: one line per
                             (update, K, prompt, sample), as `ouro eval` writes them
      rollouts/update_000003.jsonl   every sample of an update: tokens, depths, logprobs, reward
      metrics.png            reward and mean exit depth per update (at the end with --plot; `ouro plot`)
      logs/warnings.log      third-party warnings of every command run on it (ouro_cli/warnings_log.py)
      logs/tensorboard/      --logger tensorboard's event files (loggers.py)
      logs/wandb/, logs/wandb_id   --logger wandb's files, and its run id, which a resume continues
      hf/                    optional HF export (--export-hf)
      ouro.lock              held by the one process working in the run (lock.py)
      COMPLETE               the run reached its `--updates` and finished (artifacts.py)

Records before checkpoints: an update's rollouts file and metrics line are on disk before
the save that includes the update starts (records.py), so every checkpoint's updates are
logged, and a resume only ever drops lines that come after its checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ouro_cli.artifacts import MARKER

from .lock import LOCK_FILE


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def plan(self) -> Path:
        return self.root / "ouro-plan.json"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def evaluations(self) -> Path:
        return self.root / "evaluations.jsonl"

    @property
    def responses(self) -> Path:
        return self.root / "responses.jsonl"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    def rollout_file(self, update: int) -> Path:
        return self.rollouts / f"update_{update:06d}.jsonl"

    @property
    def plot(self) -> Path:
        return self.root / "metrics.png"

    @property
    def warnings_log(self) -> Path:
        return self.root / "logs" / "warnings.log"

    @property
    def tensorboard(self) -> Path:
        return self.root / "logs" / "tensorboard"

    @property
    def wandb_id(self) -> Path:
        return self.root / "logs" / "wandb_id"

    @property
    def hf_export(self) -> Path:
        return self.root / "hf"

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    def is_run(self) -> bool:
        return self.plan.is_file()

    def has_checkpoint(self) -> bool:
        """Whether a save ever committed (a tracker, or a complete iteration without one)."""
        from ouro_cli.checkpoint.layout import is_megatron_checkpoint  # the package imports torch

        return is_megatron_checkpoint(self.checkpoint)

    def own_paths(self) -> list[Path]:
        """The entries of the root that the run itself writes: no other command's output may be
        one of them or lie inside one (ouro_cli/outputs.py). `hf_export` is not among them: it
        is where an export of the run goes."""
        return [
            self.plan,
            self.manifest,
            self.checkpoint,
            self.metrics,
            self.evaluations,
            self.responses,
            self.rollouts,
            self.plot,
            self.lock,
            self.warnings_log.parent,
            self.root / MARKER,
        ]

    def foreign_entries(self) -> list[str]:
        """Names in the root that are not part of a run's layout (a directory that is not a run)."""
        known = {p.name for p in self.own_paths()}
        known |= {f"{n}.tmp" for n in (self.metrics.name, self.evaluations.name, self.responses.name)}
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.name not in known and not (p.name.startswith(".") and ".tmp" in p.name)
        )
