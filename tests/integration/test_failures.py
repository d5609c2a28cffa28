"""What every failure leaves behind, run as the real CLI: each test reproduces a
failure and checks the exit code, the one line, and what is on disk.

- overlapping outputs: `--overwrite` never deletes an input (train, eval, export, verify-resume);
- rewards that are not finite real numbers stop the run before it trains on them;
- two processes on one run directory: the second is refused, naming the first;
- runs that cannot continue say why; unfinished runs are read at their latest checkpoint;
- bad TOML types, impossible batch sizes and unwritable directories are one line, exit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ouro_cli.rl.lock import read_lock

from .harness import error_line, finish, holding_lock, metrics_updates, run, run_all, start, tracker
from .tiny_checkpoint import REWARD, make_checkpoint


def small(root: Path) -> list[object]:
    return [
        "--model",
        root / "hf",
        "--data",
        root / "train.jsonl",
        "--eval-data",
        root / "eval.jsonl",
        "--depths",
        "2",
        "3",
        "--prompts-per-update",
        "2",
        "--group-size",
        "3",
        "--max-response-len",
        "6",
        "--eval-prompts",
        "2",
        "--eval-depths",
        "2",
        "--max-num-seqs",
        "4",
        "--reward-function",
        REWARD,
    ]


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-update run (checkpoint at 2), trained while a second `ouro train` on the
    same run directory is refused; then two concurrent resumes, one refused."""
    root = tmp_path_factory.mktemp("failures")
    make_checkpoint(root)
    run_dir = root / "run"
    first = start("train", *small(root), "--updates", "2", "--run-dir", run_dir, "--json", cwd=root)
    with holding_lock(first, run_dir) as holder:  # held however long the second takes to start
        second = run("train", *small(root), "--updates", "2", "--run-dir", run_dir, "--json", cwd=root)
    done = finish(first)
    return root, run_dir, holder, second, (done.returncode, done.stdout, done.stderr)


def test_two_trains_on_one_run_directory_one_is_refused_and_the_other_completes(finished):
    root, run_dir, holder, second, (code, stdout, stderr) = finished
    assert second.returncode == 2
    assert error_line(second) == (
        f"error: {run_dir} is in use by {holder.describe()}; wait for it to finish or stop it, then run this again"
    )
    assert json.loads(second.stdout)["ok"] is False
    assert code == 0, stderr
    assert json.loads(stdout)["ok"] is True
    assert metrics_updates(run_dir) == [0, 1] and tracker(run_dir) == "2" and (run_dir / "COMPLETE").is_file()
    assert not (run_dir / "metrics.png").exists()  # drawn only with --plot
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == ["update_000000.jsonl", "update_000001.jsonl"]
    assert read_lock(run_dir) is None


def test_two_concurrent_resumes_one_is_refused(finished, tmp_path):
    root, run_dir, _, _, _ = finished
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    first = start("resume", copy, "--updates", "3", cwd=root)
    with holding_lock(first, copy):  # its one update would otherwise end before the others start up
        second, compare = run_all(
            ["resume", copy, "--updates", "3"], ["verify-resume", "--compare", run_dir, copy], cwd=root
        )
    for refused in (second, compare):
        assert refused.returncode == 2 and "is in use by pid" in error_line(refused)
    done = finish(first)
    assert done.returncode == 0, done.stderr
    assert metrics_updates(copy) == [0, 1, 2] and (copy / "COMPLETE").is_file()


def test_overwrite_never_deletes_an_input(finished, tmp_path):
    root, run_dir, _, _, _ = finished
    (tmp_path / "run2").mkdir()
    shutil.copy(root / "train.jsonl", tmp_path / "run2" / "train.jsonl")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "notes.txt").write_text("mine")
    before = {p: tree(p) for p in (run_dir, root / "hf", tmp_path / "run2", tmp_path / "w")}
    eval_run, train_model, train_data, export_run, vr_model, vr_foreign = run_all(
        ["eval", run_dir, "--data", root / "eval.jsonl", "--out", run_dir, "--overwrite", "--reward-function", REWARD],
        ["train", *small(root), "--run-dir", root / "hf", "--overwrite"],
        [
            "train",
            *small(root),
            "--data",
            tmp_path / "run2" / "train.jsonl",
            "--run-dir",
            tmp_path / "run2",
            "--overwrite",
        ],
        ["export", run_dir, run_dir, "--overwrite"],
        ["verify-resume", "--updates", "2", "--resume-at", "1", "--work-dir", root / "hf" / "vr", *small(root)],
        ["verify-resume", "--updates", "2", "--resume-at", "1", "--work-dir", tmp_path / "w", *small(root)],
        cwd=root,
    )
    for proc, named in (
        (eval_run, f"output {run_dir} overlaps the input {run_dir}/checkpoint"),
        (train_model, f"run directory {root / 'hf'} overlaps the input {root / 'hf'}"),
        (train_data, f"run directory {tmp_path / 'run2'} overlaps the input {tmp_path / 'run2' / 'train.jsonl'}"),
        (export_run, f"output {run_dir} overlaps the input {run_dir}/checkpoint"),
        (vr_model, f"work directory {root / 'hf' / 'vr'} overlaps the input {root / 'hf'}"),
        (
            vr_foreign,
            f"work directory {tmp_path / 'w'} is not empty (notes.txt) and is not an "
            "earlier verify-resume work directory",
        ),
    ):
        assert proc.returncode == 2, proc.stderr
        assert named in error_line(proc)
    assert {p: tree(p) for p in before} == before  # nothing deleted, nothing added


def test_an_unfinished_run_is_read_at_its_latest_checkpoint_and_says_so(finished, tmp_path):
    root, run_dir, _, _, _ = finished
    unfinished = tmp_path / "run"
    shutil.copytree(run_dir, unfinished)
    (unfinished / "COMPLETE").unlink()
    exported, evaluated = run_all(
        ["export", unfinished, tmp_path / "hf", "--json"],
        [
            "eval",
            unfinished,
            "--data",
            root / "eval.jsonl",
            "--depths",
            "2",
            "--prompts",
            "1",
            "--max-response-len",
            "2",
            "--reward-function",
            REWARD,
            "--out",
            tmp_path / "eval",
            "--json",
        ],
        cwd=root,
    )
    note = (
        f"{unfinished} is a run that has not finished (no COMPLETE marker): using its latest complete "
        "checkpoint, checkpoint/iter_0000002"
    )
    for proc in (exported, evaluated):
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["note"] == note
        assert note in " ".join(proc.stderr.split())
    assert (tmp_path / "hf" / "COMPLETE").is_file() and (tmp_path / "eval" / "COMPLETE").is_file()


@pytest.mark.parametrize(
    "fn, shown",
    [
        ("nan_reward", "returned nan"),
        ("string_reward", "returned '1.0' (str), not a number"),
        ("none_reward", "returned None (NoneType), not a number"),
        ("raising_reward", "raised ZeroDivisionError: no digits to count"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_stops_before_training(finished, tmp_path, fn, shown):
    root = finished[0]
    path = f"tests.integration.faulty_rewards:{fn}"
    proc = run(
        "train",
        *small(root),
        "--reward-function",
        path,
        "--eval-data",
        "",
        "--updates",
        "2",
        "--run-dir",
        tmp_path / "run",
        "--json",
        cwd=root,
    )
    assert proc.returncode == 1
    line = error_line(proc)
    assert line.startswith(f"error: update 0: reward function {path} {shown} for problem_id 'p")
    assert line.endswith("a reward must be a finite real number (bool, int or float)")
    assert json.loads(proc.stdout) == {"ok": False, "exit_code": 1, "error": line.removeprefix("error: ")}
    run_dir = tmp_path / "run"
    assert metrics_updates(run_dir) == [] and tracker(run_dir) is None and not (run_dir / "rollouts").exists()
    assert not (run_dir / "COMPLETE").exists() and read_lock(run_dir) is None


def test_rewards_numpy_scalars_pass_arrays_and_slow_calls_stop_the_run(finished, tmp_path):
    """An array reward stops the run in its initial evaluation; NumPy's bool is a reward; a
    reward that sleeps stops at --reward-timeout, naming the function."""
    root = finished[0]
    faulty = "tests.integration.faulty_rewards"
    array, numpy_bool, slow = run_all(
        [
            "train",
            *small(root),
            "--reward-function",
            f"{faulty}:array_reward",
            "--updates",
            "1",
            "--run-dir",
            tmp_path / "array",
        ],
        [
            "train",
            *small(root),
            "--reward-function",
            f"{faulty}:numpy_bool_reward",
            "--eval-data",
            "",
            "--updates",
            "1",
            "--run-dir",
            tmp_path / "bool",
            "--json",
        ],
        [
            "train",
            *small(root),
            "--reward-function",
            f"{faulty}:slow_reward",
            "--reward-timeout",
            "0.5",
            "--eval-data",
            "",
            "--updates",
            "1",
            "--run-dir",
            tmp_path / "slow",
        ],
        cwd=root,
    )
    assert array.returncode == 1 and error_line(array) == (
        f"error: evaluation at update 0, K=2: reward function {faulty}:array_reward returned array([1., 2.]) "
        "(ndarray), not a number for problem_id 'p0'; a reward must be a finite real number (bool, int or float)"
    )
    assert numpy_bool.returncode == 0, numpy_bool.stderr
    assert json.loads(numpy_bool.stdout)["ok"] and metrics_updates(tmp_path / "bool") == [0]
    assert slow.returncode == 1 and error_line(slow).startswith(
        f"error: update 0: reward function {faulty}:slow_reward took more than --reward-timeout 0.5 s for problem_id "
    )
    assert error_line(slow).endswith("; make it faster, or raise --reward-timeout")
    for name in ("array", "slow"):
        assert metrics_updates(tmp_path / name) == [] and tracker(tmp_path / name) is None


def test_a_signal_stops_a_command_at_once_before_a_run_has_work_to_finish(finished, tmp_path):
    """SIGTERM as a command starts (nothing imported for it yet) and SIGINT at the start of a
    run's initial evaluation: one line, exit 143/130, nothing claimed that is not there. A
    run that never saved: export and eval of it say so."""
    root, run_dir, _, _, _ = finished
    run, unsaved = tmp_path / "run", tmp_path / "unsaved"
    shutil.copytree(run_dir, unsaved, ignore=shutil.ignore_patterns("iter_*", "latest_*", "COMPLETE"))
    procs = [
        start("train", *small(root), "--run-dir", tmp_path / "early", cwd=root, fault="command=TERM"),
        start(
            "eval",
            run_dir,
            "--data",
            root / "eval.jsonl",
            "--reward-function",
            REWARD,
            "--json",
            cwd=root,
            fault="command=TERM",
        ),
        start(
            "train",
            *small(root),
            "--eval-prompts",
            "6",
            "--updates",
            "3",
            "--run-dir",
            run,
            cwd=root,
            fault="evaluation=INT",
        ),
        start("export", unsaved, tmp_path / "hf", cwd=root),
        start("eval", unsaved, "--data", root / "eval.jsonl", "--reward-function", REWARD, cwd=root),
    ]
    early_train, early_eval, in_evaluation, exported, evaluated = map(finish, procs)
    for proc in (early_train, early_eval):
        assert proc.returncode == 143 and error_line(proc) == "error: stopped by SIGTERM", proc.stderr
    assert json.loads(early_eval.stdout) == {"ok": False, "error": "stopped by SIGTERM", "exit_code": 143}
    assert not (tmp_path / "early").exists()
    assert in_evaluation.returncode == 130
    assert error_line(in_evaluation) == (
        f"error: stopped by SIGINT before its first update (no checkpoint yet: the "
        f"resume starts it again); continue with: ouro resume {run} --updates 3"
    )
    assert not (run / "evaluations.jsonl").exists() and not (run / "responses.jsonl").exists()
    assert tracker(run) is None and read_lock(run) is None
    for proc in (exported, evaluated):
        assert proc.returncode == 2 and error_line(proc) == (
            f"error: {unsaved} is a run that has not saved a checkpoint yet; read it after its first save "
            "(--save-interval), or continue it with `ouro resume`"
        )


def test_a_runtime_failure_is_one_line_and_one_json_document(finished, tmp_path):
    root = finished[0]
    proc = run(
        "train", *small(root), "--kv-blocks", "1", "--eval-data", "", "--run-dir", tmp_path / "run", "--json", cwd=root
    )
    assert proc.returncode == 1
    line = error_line(proc)
    assert line.startswith("error: --kv-blocks 1 holds ") and "raise --kv-blocks" in line
    assert json.loads(proc.stdout)["error"] == line.removeprefix("error: ")
    assert tracker(tmp_path / "run") is None  # refused before any model loads: nothing to resume, `train` starts it


def test_runs_that_cannot_continue_say_why(finished, tmp_path):
    root, run_dir, _, _, _ = finished
    damaged, gap = tmp_path / "damaged", tmp_path / "gap"
    for copy in (damaged, gap):
        shutil.copytree(run_dir, copy)
        (copy / "COMPLETE").unlink()
    (damaged / "checkpoint" / "iter_0000002" / "trainer_state.json").write_text("{")
    lines = (gap / "metrics.jsonl").read_text().splitlines(keepends=True)
    (gap / "metrics.jsonl").write_text(lines[1])
    before = {p: tree(p) for p in (damaged, gap, run_dir)}
    bad_state, has_gap, complete = run_all(
        ["resume", damaged, "--updates", "3"],
        ["resume", gap, "--updates", "3"],
        ["resume", run_dir, "--updates", "2"],
        cwd=root,
    )
    assert bad_state.returncode == 2 and error_line(bad_state).startswith(
        f"error: {damaged}/checkpoint/iter_0000002/trainer_state.json is damaged (JSONDecodeError: "
    )
    assert has_gap.returncode == 2 and error_line(has_gap) == (
        f"error: {gap}: the checkpoint at update 2 includes update(s) 0, but metrics.jsonl has no line for them; "
        "resuming would leave the records with a gap. Restore the records from a copy of the run, or start over "
        "with `ouro train --overwrite`"
    )
    assert complete.returncode == 2 and error_line(complete) == (
        "error: the run already has 2 updates; ask for more with --updates"
    )
    assert {p: tree(p) for p in before} == before  # COMPLETE stays: the refusal touches nothing


def test_bad_input_is_one_line_before_any_model_loads(tmp_path):
    make_checkpoint(tmp_path)
    (tmp_path / "types.toml").write_text('updates = "ten"\n')
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("x")
    procs = run_all(
        ["train", *small(tmp_path), "--prompts-per-update", "100000", "--run-dir", tmp_path / "big"],
        ["train", "--config", tmp_path / "types.toml", "--run-dir", tmp_path / "types"],
        ["train", *small(tmp_path), "--group-size", "0", "--run-dir", tmp_path / "g0"],
        ["train", *small(tmp_path), "--group-size", "1", "--run-dir", tmp_path / "g1"],
        ["train", *small(tmp_path), "--run-dir", "/sys/ouro-test-run", "--json"],
        ["train", *small(tmp_path), "--run-dir", tmp_path / "taken"],
        cwd=tmp_path,
    )
    lines = [error_line(p) for p in procs]
    assert all(p.returncode == 2 for p in procs), [p.stderr for p in procs]
    assert lines[0] == (
        f"error: --prompts-per-update 100000 is more than the 40 rows of {tmp_path / 'train.jsonl'}: "
        "an update would repeat prompts; use at most 40"
    )
    assert lines[1] == f"error: --config {tmp_path / 'types.toml'}: updates must be an integer, got 'ten' (str)"
    assert lines[2].replace("got 0", "got 1") == lines[3]
    assert lines[4].startswith("error: run directory /sys/ouro-test-run cannot be written (/sys: ")
    assert json.loads(procs[4].stdout)["exit_code"] == 2
    assert "is not empty (mine.txt) and is not an ouro run" in lines[5]
    assert not any((tmp_path / d).exists() for d in ("big", "types", "g0", "g1"))
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]


def test_more_bad_input_is_one_line_exit_2(tmp_path):
    """Depths and loops beyond the model, an option set twice in the TOML, a model path that
    is a link loop, a chat role the template does not know; and `data check --model` refuses
    the prompt `train` refuses, with the same line."""
    make_checkpoint(tmp_path)
    (tmp_path / "twice.toml").write_text("[trainer]\nlr = 1e-4\n[optimizer]\nlr = 2e-4\n")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    rows[2]["prompt"] = [{"role": "system", "content": "be brief"}, {"role": "wizard", "content": rows[2]["prompt"]}]
    (tmp_path / "wizard.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows[2]["prompt"] = "1+2=?" * 100  # 500 tokens: no room for 6 response tokens within the model's 512
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    procs = run_all(
        ["train", *small(tmp_path), "--eval-depths", "7", "--run-dir", tmp_path / "r1"],
        ["train", *small(tmp_path), "--min-loops", "9", "--run-dir", tmp_path / "r2"],
        ["train", *small(tmp_path), "--config", tmp_path / "twice.toml", "--run-dir", tmp_path / "r3"],
        ["train", *small(tmp_path), "--model", tmp_path / "loop_a", "--run-dir", tmp_path / "r4"],
        ["train", *small(tmp_path), "--data", tmp_path / "wizard.jsonl", "--run-dir", tmp_path / "r5"],
        ["train", *small(tmp_path), "--data", tmp_path / "long.jsonl", "--run-dir", tmp_path / "r6"],
        ["data", "check", tmp_path / "long.jsonl", "--model", tmp_path / "hf", "--max-response-len", "6"],
        cwd=tmp_path,
    )
    assert all(p.returncode == 2 for p in procs), [p.stderr for p in procs]
    lines = [error_line(p) for p in procs]
    assert lines[0].startswith("error: --eval-depths: K=7 is outside 1..4")
    assert lines[1] == "error: --min-loops 9 is more than the model's total_ut_steps=4 loops; use at most 4"
    assert (
        lines[2]
        == f"error: --config {tmp_path / 'twice.toml'}: lr is set twice, at [trainer] and at [optimizer]; keep one"
    )
    assert lines[3] == f"error: {tmp_path / 'loop_a'} is a symbolic link loop; point it at a real file or directory"
    assert lines[4] == (
        f"error: {tmp_path / 'wizard.jsonl'}:3: message 1 has the role 'wizard', which the chatml "
        "prompt template does not know; use one of system, user, assistant"
    )
    assert lines[5].startswith(f"error: {tmp_path / 'long.jsonl'}:3: prompt of ") and lines[5] == lines[6]
    assert not any((tmp_path / f"r{i}" / "checkpoint").exists() for i in range(1, 7))


COMMANDS = [
    ["train"],
    ["resume"],
    ["eval"],
    ["export"],
    ["verify-resume"],
    ["probe-ucx"],
    ["convert"],
    ["convert", "hf-to-mcore"],
    ["convert", "mcore-to-hf"],
    ["data"],
    ["data", "check"],
    [],
]


def test_help_shows_defaults_and_whole_option_names_at_80_columns(tmp_path):
    procs = [finish(p) for p in [start(*command, "--help", cwd=tmp_path, COLUMNS="80") for command in COMMANDS]]
    for command, proc in zip(COMMANDS, procs, strict=True):
        assert proc.returncode == 0, proc.stderr
        assert "…" not in proc.stdout, (command, proc.stdout)
        for name, text in _option_rows(proc.stdout).items():
            if name != "--help":
                assert "[default:" in text or "[required]" in text, (command, name, text)
    assert "Examples:" in procs[-1].stdout and "Examples:" in procs[COMMANDS.index(["convert"])].stdout


def _option_rows(help_text: str) -> dict[str, str]:
    """Option name -> its help text (joined over wrapped lines) in a Rich help screen."""
    rows: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        cells = line.strip("│ ").split()
        if not cells or not line.startswith("│"):  # outside the option panels
            current = None
            continue
        first = cells[1] if cells[0] == "*" and len(cells) > 1 else cells[0]
        if first.startswith("--") and line.index(first) <= 6:  # a name, not wrapped help text
            current = first
            rows[current] = line
        elif current is not None:
            rows[current] += " " + line
    return {k: " ".join(v.replace("│", " ").split()) for k, v in rows.items()}
