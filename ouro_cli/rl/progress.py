"""What a GRPO run tells the person watching it: the interface between the loop (rl/loop.py)
and a display (ouro_cli/cli/progress.py), so that the loop, the engine and the trainer hold no UI.

The loop announces each stage as it begins (`Stage`: rollout, refill, train, publish, save,
evaluation), each update's metrics record once it is written, and each held-out evaluation;
`detail` gets the lines worth showing only on request (`--verbose`). The work done inside a
stage is counted by the engine and the trainer themselves (engine.contract.GenerateProgress,
trainer.step.StepProgress), and a display reads those counters when it redraws: the decode
and micro-batch loops only assign a number, and never call out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Stage:
    """A stage of the run that has begun. `update` is the update it belongs to (an
    evaluation's: the updates done before it); `k` the rollout's decode budget; `when` an
    evaluation's moment (start, interval, end) and `depths` its budgets, one generate call
    each, in order; `counter` what counts its work, or None."""

    name: str
    update: int | None = None
    k: int | None = None
    when: str = ""
    depths: tuple[int, ...] = ()
    counter: Any = None


class RunProgress(Protocol):
    def stage(self, stage: Stage) -> None: ...

    def updated(self, record: dict[str, Any]) -> None: ...

    def evaluated(self, update: int, when: str, results: list[dict[str, Any]]) -> None: ...

    def detail(self, message: str) -> None: ...


class Silent:
    """A RunProgress that shows nothing: the default of the Python API (`loop.train`)."""

    def stage(self, stage: Stage) -> None:
        pass

    def updated(self, record: dict[str, Any]) -> None:
        pass

    def evaluated(self, update: int, when: str, results: list[dict[str, Any]]) -> None:
        pass

    def detail(self, message: str) -> None:
        pass
