"""The progress display of `ouro train` and `ouro resume` (a `rl.progress.RunProgress`), on stderr.

On a terminal, a live display of two lines: updates done of N with the elapsed time, the ETA
and the running reward per K (the mean of the last `WINDOW` updates at that K), then the stage
at work (rollout: sequences finished of the call's and tokens decoded; train: step and
micro-batch; save; evaluation), read from the engine's and the trainer's counters at each
redraw. Off a terminal (a pipe, a file, a job log), plain lines that never wrap: one per update,
and one per `HEARTBEAT` seconds of a stage that runs longer, so a long rollout still shows life.
Held-out evaluations during the run print their table (a line per K off a terminal); the end's
is the command's summary (cli/train.py). `--verbose` adds the details a newcomer does not need
(the execution plan's hash, the weight versions).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ouro_cli.engine.contract import GenerateProgress
from ouro_cli.rl.progress import Stage
from ouro_cli.trainer.step import StepProgress

WINDOW = 10  # updates per K in the running reward, and the ETA's recent updates
HEARTBEAT = 30.0  # seconds of a stage without a line before a plain line says where it stands


def clock(seconds: float | None) -> str:
    """`seconds` as H:MM:SS (M:SS under an hour); None or a negative as -:--."""
    if seconds is None or seconds < 0:
        return "-:--"
    s = round(seconds)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def eta_seconds(durations: Iterable[float], remaining: int) -> float | None:
    """The time `remaining` updates take at the mean of `durations` (the recent updates'); None
    before any update ended."""
    recent = list(durations)
    return sum(recent) / len(recent) * remaining if recent else None


class RunningRewards:
    """The mean training reward of the last `window` updates at each K."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.by_k: dict[int, deque[float]] = {}

    def add(self, k: int, reward: float) -> None:
        self.by_k.setdefault(k, deque(maxlen=self.window)).append(reward)

    def text(self) -> str:
        shown = "  ".join(f"K={k} {sum(r) / len(r):.3f}" for k, r in sorted(self.by_k.items()))
        return f"running reward  {shown}" if shown else ""


def update_line(record: dict[str, Any], updates: int, eta: float | None, rewards: str, verbose: bool = False) -> str:
    """The plain line of one update: n/N, K, its reward, its time (and the part spent compiling,
    so a slow update is not mistaken for a slow run), the ETA and the running reward per K."""
    compiling = record.get("compile_s", 0.0)
    note = f" ({compiling:.1f}s compiling)" if compiling >= 0.5 else ""
    version = f"  policy v{record['weight_version']}" if verbose else ""
    return (
        f"update {record['update'] + 1}/{updates}  K={record['k']}{version}  reward {record['reward_mean']:.3f}  "
        f"step {record['step_s']:.2f}s{note}  ETA {clock(eta)}" + (f"  |  {rewards}" if rewards else "")
    )


def work_text(counter: Any) -> str:
    """What the counter of a stage says has been done ("" for none)."""
    if isinstance(counter, GenerateProgress) and counter.sequences:
        return (
            f"{counter.finished}/{counter.sequences} sequences done, {counter.tokens:,} tokens "
            f"(of at most {counter.max_tokens:,})"
        )
    if isinstance(counter, StepProgress) and counter.micro_batches:
        step = f"step {counter.step}/{counter.steps}, " if counter.steps > 1 else ""
        return f"{step}micro-batch {counter.micro_batch}/{counter.micro_batches}"
    return ""


def stage_text(stage: Stage, updates: int, calls: int = 0) -> str:
    """The stage at work, with what its counter says has been done; `calls`: the generate calls
    its counter had counted when the stage began (an evaluation makes one per K)."""
    where = f"update {stage.update + 1}/{updates}: " if stage.update is not None else ""
    name = {
        "rollout": f"rollout at K={stage.k}",
        "refill": f"refill rounds at K={stage.k}",
        "train": "train",
        "publish": "publishing the weights to the engine",
        "save": f"saving the checkpoint of update {stage.update}",
        "evaluation": f"held-out evaluation ({stage.when})",
        "export": "exporting the final model",
    }.get(stage.name, stage.name)
    if stage.name in ("save", "evaluation", "export"):
        where = ""
    counter = stage.counter
    if stage.depths and isinstance(counter, GenerateProgress) and 0 < counter.calls - calls <= len(stage.depths):
        name += f" at K={stage.depths[counter.calls - calls - 1]}"
    done = work_text(counter)
    return f"{where}{name}" + (f", {done}" if done else "")


def evaluation_title(update: int, when: str) -> str:
    return "held-out accuracy before training" if when == "start" else f"held-out accuracy after {update} updates"


def evaluation_lines(update: int, when: str, results: list[dict[str, Any]]) -> list[str]:
    """A plain line per K of a held-out evaluation."""
    title = evaluation_title(update, when)
    return [
        f"{title}: K={r['k']} {r['accuracy']:.3f} (mean exit depth {r['mean_exit_depth']:.2f}, "
        f"{r['mean_tokens']:.1f} tokens)"
        for r in results
    ]


def evaluation_table(update: int, when: str, results: list[dict[str, Any]]) -> Table:
    table = Table(title=evaluation_title(update, when))
    for col in ("K", "accuracy", "mean exit depth", "mean tokens"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["k"]), f"{r['accuracy']:.3f}", f"{r['mean_exit_depth']:.2f}", f"{r['mean_tokens']:.1f}")
    return table


class TrainDisplay:
    """A `RunProgress` for the console (module docstring): a live display on a terminal, plain
    lines elsewhere. Use it as a context manager around the run."""

    def __init__(self, console: Console, updates: int, *, verbose: bool = False, heartbeat: float = HEARTBEAT) -> None:
        self.console, self.updates, self.verbose, self.heartbeat = console, updates, verbose, heartbeat
        self.live = console.is_terminal and not console.quiet
        self.rewards = RunningRewards()
        self.durations: deque[float] = deque(maxlen=WINDOW)
        self.done = 0
        self.started = time.monotonic()
        # the stage at work, when it began, and the generate calls its counter had counted then:
        # one tuple, assigned at once, for the redrawing thread to read whole
        self.current: tuple[Stage, float, int] | None = None
        self.last_line = self.started
        self.update_started: float | None = None
        self._live: Live | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the context ----------------------------------------------------------------

    def __enter__(self) -> TrainDisplay:
        if self.live:
            self._live = Live(console=self.console, get_renderable=self._render, refresh_per_second=4)
            self._live.__enter__()
        elif self.heartbeat > 0:
            self._thread = threading.Thread(target=self._beat, name="ouro-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current = None  # the last frame shows the updates only
        if self._live is not None:
            self._live.__exit__(*exc)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    # ---- RunProgress ----------------------------------------------------------------

    def stage(self, stage: Stage) -> None:
        now = time.monotonic()
        if stage.name == "rollout" and self.update_started is None:
            self.update_started = now
        calls = stage.counter.calls if isinstance(stage.counter, GenerateProgress) else 0
        self.current = (stage, now, calls)

    def updated(self, record: dict[str, Any]) -> None:
        now = time.monotonic()
        if self.update_started is not None:
            self.durations.append(now - self.update_started)
        self.update_started = now
        self.done = record["update"] + 1
        self.rewards.add(record["k"], record["reward_mean"])
        if not self.live:
            self._say(update_line(record, self.updates, self.eta(), self.rewards.text(), self.verbose))

    def evaluated(self, update: int, when: str, results: list[dict[str, Any]]) -> None:
        if when == "end":  # the command's summary shows it (cli/train.py)
            return
        if self.live:
            self.console.print(evaluation_table(update, when, results))
        else:
            for line in evaluation_lines(update, when, results):
                self._say(line)

    def detail(self, message: str) -> None:
        if self.verbose:
            self.console.print(f"[dim]{escape(message)}[/]", soft_wrap=not self.live)

    # ---- what is shown --------------------------------------------------------------

    def eta(self) -> float | None:
        return eta_seconds(self.durations, self.updates - self.done)

    def _render(self) -> Group:
        now = time.monotonic()
        head = Table.grid(padding=(0, 1))
        head.add_row(
            Text("GRPO", style="bold"),
            ProgressBar(total=self.updates, completed=self.done, width=30),
            Text(f"{self.done}/{self.updates}"),
            Text(f"{clock(now - self.started)} elapsed, ETA {clock(self.eta())}"),
            Text(self.rewards.text(), style="cyan"),
        )
        current = self.current
        if current is None:
            return Group(head)
        return Group(head, Text(f"  {self._stage_line(current, now)}", style="dim"))

    def _stage_line(self, current: tuple[Stage, float, int], now: float) -> str:
        stage, started, calls = current
        return f"{stage_text(stage, self.updates, calls)} ({clock(now - started)})"

    def _say(self, line: str) -> None:
        self.last_line = time.monotonic()
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _beat(self) -> None:
        """Off a terminal: a line for a stage that has run `heartbeat` seconds since the last line."""
        while not self._stop.wait(self.heartbeat / 4):
            current, now = self.current, time.monotonic()
            if current is not None and now - max(current[1], self.last_line) >= self.heartbeat:
                self._say(self._stage_line(current, now))
