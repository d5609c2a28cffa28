"""The one place that knows the run directory layout; every command asks it.

    RUN/
      ouro-plan.json         the run's contract and `next_update`; rewritten with each checkpoint
      manifest.json          how the run was started (command, options, inputs, versions)
      checkpoint/            Megatron checkpoint (see ouro_cli/checkpoint/layout.py)
      metrics.jsonl          one JSON line per update
      evaluations.jsonl      held-out accuracy per K, one line per (update, K)
      rollouts/update_000003.jsonl   every sample of an update: tokens, depths, logprobs, reward
      metrics.png            reward and mean exit depth per update (written at the end)
      logs/warnings.log      third-party warnings of every command run on it (ouro_cli/warnings_log.py)
      hf/                    optional HF export (--export-hf)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
    def hf_export(self) -> Path:
        return self.root / "hf"

    def is_run(self) -> bool:
        return self.plan.is_file()
