"""Readers and writers of one run, as the real CLI: nothing an export can destroy, no run
left stuck.

One training run (`--save-interval 1 --keep-last 1`, started with relative `--data` and
`--eval-data`) while `ouro export` runs beside it, two at a time into one new output, round
after round, and this process reads the latest checkpoint in a loop between them: every
export exits 0 with a whole model or 2 with one line, of each pair exactly one writes the
output, and no reader is turned away because training pruned the checkpoint it read. Then, on that run: outputs that
would replace its files or a user's folder are refused
and change nothing; a run whose held-out set is gone says so and how to go on; a damaged
checkpoint removed as the error says resumes, from another folder, with a new `--eval-data`.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from ouro_cli.checkpoint import open_checkpoint

from .harness import error_line, finish, metrics_updates, run_all, start, tracker
from .tiny_checkpoint import REWARD, make_checkpoint

pytestmark = pytest.mark.slow

UPDATES = 12


def small(*extra: object) -> list[object]:
    return [
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
        *extra,
    ]


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def read_latest(run: Path) -> tuple[str, int, int]:
    """What a reader in this process gets from the run: (iteration, tensors read, tensors the
    config asks for), or an exception."""
    source = open_checkpoint(run)
    try:
        return source.path.name, sum(1 for _ in source.iter_tensors()), len(source.specs)
    finally:
        source.release()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run, every round of two exports into one new output made while it trained (started
    while training, output, the two exports), and the reads this process made meanwhile."""
    from megatron.core import dist_checkpointing  # noqa: F401 - imported now, not during the first read

    root = tmp_path_factory.mktemp("readers")
    make_checkpoint(root)
    shutil.copy(root / "eval.jsonl", root / "ev.jsonl")
    train = start(
        "train",
        "--model",
        "hf",
        "--data",
        "train.jsonl",
        "--eval-data",
        "ev.jsonl",
        *small(),
        "--updates",
        UPDATES,
        "--save-interval",
        1,
        "--keep-last",
        1,
        "--run-dir",
        "run",
        cwd=root,
    )
    deadline = time.monotonic() + 300
    while tracker(root / "run") is None:  # the first checkpoint: from now on a reader has one to read
        assert train.poll() is None and time.monotonic() < deadline, finish(train).stderr
        time.sleep(0.05)
    rounds, reads, pair = [], [], None
    while pair is not None or train.poll() is None or not rounds:
        if pair is None:
            out = root / f"export-{len(rounds)}"
            pair = (train.poll() is None, out, [start("export", "run", out, cwd=root) for _ in range(2)])
        elif all(p.poll() is not None for p in pair[2]):
            rounds.append((pair[0], pair[1], [finish(p) for p in pair[2]]))
            pair = None
        else:  # between the exports' own reads, one here: many reads meet a save and its prune
            try:
                reads.append(read_latest(root / "run"))
            except Exception as err:  # noqa: BLE001 - what a reader met, reported by the test
                reads.append(err)
    return root, finish(train), rounds, reads


def test_readers_while_training_read_a_whole_checkpoint_and_one_writer_wins(trained):
    root, train, rounds, reads = trained
    assert train.returncode == 0, train.stderr
    assert any(during for during, _, _ in rounds) and len({r[0] for r in reads if isinstance(r, tuple)}) > 2
    assert [r for r in reads if not (isinstance(r, tuple) and r[1] == r[2] > 0)] == []
    for _, out, pair in rounds:
        assert sorted(p.returncode for p in pair) == [0, 2], [p.stderr for p in pair]
        loser = next(p for p in pair if p.returncode == 2)
        # the loser meets the winner's lock while it writes, or its finished output after
        assert re.search(rf"error: ({out} is in use by pid \d+|output {out} is not empty)", error_line(loser))
        assert (out / "COMPLETE").is_file()
        model = open_checkpoint(out)  # every tensor the config asks for, with its shape
        assert model.kind == "hf" and sum(1 for _ in model.iter_tensors()) == len(model.specs) > 0
    assert metrics_updates(root / "run") == list(range(UPDATES)) and tracker(root / "run") == str(UPDATES)


def test_outputs_that_would_replace_a_run_or_a_folder_are_refused(trained, tmp_path):
    root = trained[0]
    run = root / "run"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = {p: tree(p) for p in (run, mine, copy)}
    model = ["--model", root / "hf", "--data", root / "train.jsonl", "--eval-data", root / "eval.jsonl"]
    rollouts, new_iter, folder, own_rollouts, other_run = run_all(
        ["export", run, run / "rollouts", "--overwrite"],
        ["export", run, run / "checkpoint" / "iter_0000099"],
        ["train", *model, *small(), "--run-dir", tmp_path / "new", "--export-hf", mine],
        ["train", *model, *small(), "--run-dir", tmp_path / "new2", "--export-hf", tmp_path / "new2" / "rollouts"],
        ["resume", copy, "--updates", UPDATES + 1, "--export-hf", run],
        cwd=root,
    )
    for proc, line in (
        (rollouts, f"output {run}/rollouts lies inside the run directory {run} (rollouts"),
        (new_iter, f"output {run}/checkpoint/iter_0000099 lies inside the run directory {run}"),
        (folder, f"--export-hf {mine} is not empty; choose another or pass --overwrite"),
        (own_rollouts, f"--export-hf {tmp_path}/new2/rollouts lies inside the run directory {tmp_path}/new2 (rollouts"),
        (other_run, f"--export-hf {run} is not empty; choose another or remove it"),
    ):
        assert proc.returncode == 2, proc.stderr
        assert line in error_line(proc)
    assert {p: tree(p) for p in before} == before
    assert not (tmp_path / "new").exists() and not (tmp_path / "new2").exists()


def test_a_run_that_lost_its_eval_set_or_a_checkpoint_resumes_from_another_folder(trained, tmp_path):
    root = trained[0]
    damaged, no_eval = tmp_path / "damaged", tmp_path / "no-eval"
    for copy in (damaged, no_eval):
        shutil.copytree(root / "run", copy)
    latest = damaged / "checkpoint" / f"iter_{UPDATES:07d}"
    for older in set(latest.parent.glob("iter_*")) - {latest}:  # one a reader held at the last prune
        shutil.rmtree(older)
    (latest / "trainer_state.json").write_text("{")
    (root / "ev.jsonl").unlink()
    bad_state, eval_gone = run_all(
        ["resume", damaged, "--updates", UPDATES + 1], ["resume", no_eval, "--updates", UPDATES + 1], cwd=root
    )
    assert bad_state.returncode == 2 and f"remove {latest} to resume from the iteration before it" in error_line(
        bad_state
    )
    assert eval_gone.returncode == 2 and error_line(eval_gone) == (
        f"error: the held-out set --eval-data {root / 'ev.jsonl'} (given as ev.jsonl) does not exist; it is not "
        "part of the run's contract: pass --eval-data with another held-out file, or --eval-data '' to evaluate "
        "nothing"
    )
    shutil.rmtree(latest)  # what the error says; it was the only checkpoint: the run starts again
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(root / "eval.jsonl", elsewhere / "held-out.jsonl")
    resumed = finish(start("resume", damaged, "--updates", 2, "--eval-data", "held-out.jsonl", cwd=elsewhere))
    assert resumed.returncode == 0, resumed.stderr
    assert "never saved a checkpoint: starting it again from update 0" in " ".join(resumed.stderr.split())
    assert metrics_updates(damaged) == [0, 1] and tracker(damaged) == "2" and (damaged / "COMPLETE").is_file()
    plan = json.loads((damaged / "ouro-plan.json").read_text())
    assert plan["options"]["data"] == str(root / "train.jsonl") and plan["given_paths"]["data"] == "train.jsonl"
    evaluations = [json.loads(x) for x in (damaged / "evaluations.jsonl").read_text().splitlines()]
    assert [(e["update"], e["when"]) for e in evaluations] == [(0, "start"), (2, "end")]
