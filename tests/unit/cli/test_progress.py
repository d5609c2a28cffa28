"""The progress display of `ouro train` (cli/progress.py) and the consoles it writes through
(cli/common.py): what each line says, plain lines that never wrap off a terminal, the heartbeat
of a long stage, and the live display's two lines on a terminal."""

from __future__ import annotations

import io
import time

from rich.console import Console

from ouro_cli.cli import common
from ouro_cli.cli.progress import (
    TrainDisplay,
    clock,
    eta_seconds,
    evaluation_lines,
    stage_text,
    update_line,
    work_text,
)
from ouro_cli.engine.contract import GenerateProgress
from ouro_cli.rl.progress import Stage
from ouro_cli.trainer.step import StepProgress

RESULTS = [
    {"k": 2, "accuracy": 0.46, "mean_exit_depth": 2.0, "mean_tokens": 18.4},
    {"k": 3, "accuracy": 0.52, "mean_exit_depth": 3.0, "mean_tokens": 18.5},
]


def record(update: int, k: int, reward: float, **extra) -> dict:
    return {"update": update, "k": k, "reward_mean": reward, "step_s": 1.25, "weight_version": update + 1, **extra}


def plain(width: int = 40) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=width, force_terminal=False, highlight=False), out


def test_clock_and_eta():
    assert [clock(x) for x in (None, -1, 0, 59.4, 61, 3600 + 62)] == ["-:--", "-:--", "0:00", "0:59", "1:01", "1:01:02"]
    assert eta_seconds([], 10) is None
    assert eta_seconds([1.0, 3.0], 10) == 20.0 and eta_seconds([2.0], 0) == 0.0


def test_update_line_says_n_of_n_eta_and_running_reward_and_the_version_only_when_verbose():
    line = update_line(record(11, 3, 0.4121, compile_s=2.0), 80, 130.0, "running reward  K=3 0.412")
    assert line == (
        "update 12/80  K=3  reward 0.412  step 1.25s (2.0s compiling)  ETA 2:10  |  running reward  K=3 0.412"
    )
    assert "v12" not in line
    assert "policy v12" in update_line(record(11, 3, 0.4), 80, None, "", verbose=True)


def test_stage_text_names_the_stage_and_its_counted_work():
    rollout = GenerateProgress(calls=4, sequences=256, finished=120, tokens=3100, max_tokens=12288)
    assert stage_text(Stage("rollout", 12, 3, counter=rollout), 80) == (
        "update 13/80: rollout at K=3, 120/256 sequences done, 3,100 tokens (of at most 12,288)"
    )
    train = StepProgress(step=1, steps=2, micro_batch=3, micro_batches=5)
    assert stage_text(Stage("train", 12, 3, counter=train), 80) == "update 13/80: train, step 1/2, micro-batch 3/5"
    assert work_text(StepProgress(step=1, steps=1, micro_batch=0, micro_batches=2)) == "micro-batch 0/2"
    assert work_text(GenerateProgress()) == "" and work_text(None) == ""
    assert stage_text(Stage("save", 20), 80) == "saving the checkpoint of update 20"
    # an evaluation makes one generate call per K: the calls since it began say which K runs
    evaluation = Stage("evaluation", 20, when="interval", depths=(2, 3, 4), counter=rollout)
    assert stage_text(evaluation, 80, calls=2).startswith("held-out evaluation (interval) at K=3, 120/256")
    assert stage_text(evaluation, 80, calls=4).startswith("held-out evaluation (interval), 120/256")


def test_evaluation_lines_one_per_k():
    assert evaluation_lines(0, "start", RESULTS) == [
        "held-out accuracy before training: K=2 0.460 (mean exit depth 2.00, 18.4 tokens)",
        "held-out accuracy before training: K=3 0.520 (mean exit depth 3.00, 18.5 tokens)",
    ]
    assert evaluation_lines(20, "interval", RESULTS)[0].startswith("held-out accuracy after 20 updates: K=2 0.460")


def test_plain_display_one_unwrapped_line_per_update_and_evaluation_and_details_only_when_verbose():
    console, out = plain(width=40)
    with TrainDisplay(console, 80, heartbeat=0) as display:
        display.detail("execution plan e551f2504bff")
        display.evaluated(0, "start", RESULTS)
        for update, k in enumerate((2, 3, 4, 2)):
            display.stage(Stage("rollout", update, k))
            display.updated(record(update, k, 0.25 * (update + 1)))
        display.evaluated(80, "end", RESULTS)  # the command's summary shows the end's
    lines = out.getvalue().splitlines()
    assert len(lines) == 6 and all(len(line) > 40 for line in lines), lines  # 40 columns, none wrapped
    assert lines[0].startswith("held-out accuracy before training: K=2")
    assert lines[2].startswith("update 1/80  K=2  reward 0.250")
    assert lines[5].startswith("update 4/80  K=2  reward 1.000") and "running reward  K=2 0.625  K=3 0.500" in lines[5]
    assert "ETA" in lines[5] and "-:--" not in lines[5]

    console, out = plain()
    with TrainDisplay(console, 80, verbose=True, heartbeat=0) as display:
        display.detail("execution plan e551f2504bff")
    assert out.getvalue() == "execution plan e551f2504bff\n"


def test_plain_display_reports_a_long_stage_every_heartbeat():
    console, out = plain()
    counter = GenerateProgress(calls=1, sequences=8, finished=3, tokens=120, max_tokens=400)
    with TrainDisplay(console, 5, heartbeat=0.05) as display:
        display.stage(Stage("rollout", 0, 2, counter=counter))
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines and lines[0].startswith("update 1/5: rollout at K=2, 3/8 sequences done, 120 tokens (of at most 400)")
    assert len(lines) < 10  # one per heartbeat, not one per check


def test_terminal_display_shows_updates_eta_rewards_and_the_stage():
    console = Console(file=io.StringIO(), width=160, force_terminal=True, record=True)
    with TrainDisplay(console, 10) as display:
        display.stage(Stage("rollout", 0, 2))
        display.updated(record(0, 2, 0.5))
        display.stage(Stage("train", 1, 3, counter=StepProgress(step=1, steps=1, micro_batch=1, micro_batches=2)))
        frame = display._render()
    console.print(frame)
    text = console.export_text()
    assert "1/10" in text and "ETA" in text and "running reward  K=2 0.500" in text
    assert "update 2/10: train, micro-batch 1/2" in text


def test_logs_and_reports_never_wrap_off_a_terminal(capsys):
    """The shared consoles: logs on stderr, reports on stdout (stderr under --json); neither
    wraps a long line when it is not a terminal (`make demo | tee` keeps a line per message)."""
    line = "memory: " + "x" * 200
    common.console.print(line)
    common.report_console(json_output=False).print(line)
    common.report_console(json_output=True).print("report under --json")
    captured = capsys.readouterr()
    assert captured.err == f"{line}\nreport under --json\n" and captured.out == f"{line}\n"
