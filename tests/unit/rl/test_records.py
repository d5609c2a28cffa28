"""Records against checkpoints (ouro_cli.rl.records, checkpoint.layout): a resume drops what
ran after its checkpoint, refuses a gap below it, recognises an iteration whose save was
interrupted before its tracker write, and continues once a damaged iteration is removed."""

from __future__ import annotations

import json
import shutil

import pytest

from ouro_cli.artifacts import mark_complete
from ouro_cli.checkpoint import layout
from ouro_cli.errors import UserError
from ouro_cli.rl import records
from ouro_cli.rl.metrics import read_jsonl
from ouro_cli.rl.run_dir import RunDir


def _iteration(run: RunDir, n: int, *, tracker: bool = True) -> None:
    it = run.checkpoint / layout.iteration_dir_name(n)
    it.mkdir(parents=True)
    (it / records.STATE_FILE).write_text(json.dumps({"iteration": n, "extra": {"next_update": n}}))
    mark_complete(it)
    if tracker:
        (run.checkpoint / layout.TRACKER).write_text(f"{n}\n")


def _logged(run: RunDir, updates) -> None:
    for u in updates:
        records.write_update(run, u, [{"update": u, "group": 0}], {"update": u, "k": 2}, durable=u % 2 == 1)


def _drop_line(run: RunDir, update: int) -> None:
    lines = run.metrics.read_text().splitlines(keepends=True)
    run.metrics.write_text("".join(x for x in lines if json.loads(x)["update"] != update))


@pytest.fixture
def run(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    return run


def test_rows_after_the_checkpoint_are_dropped_and_a_torn_last_line_is_tolerated(run):
    _iteration(run, 2)
    _logged(run, range(4))
    with open(run.metrics, "a") as f:
        f.write('{"update": 4, "k"')  # a writer killed mid-line
    evaluations = [{"update": 0, "when": "start"}, {"update": 2, "when": "interval"}, {"update": 4, "when": "interval"}]
    run.evaluations.write_text("".join(json.dumps(e) + "\n" for e in evaluations))
    run.responses.write_text("".join(json.dumps({**e, "sample": i}) + "\n" for e in evaluations for i in range(2)))
    notes = []
    assert records.resume_point(run, 6, notes.append) == 2
    records.drop_after(run, 2, finishing=False, log=notes.append)
    assert [r["update"] for r in read_jsonl(run.metrics)] == [0, 1]
    assert [e["update"] for e in read_jsonl(run.evaluations)] == [0, 2]
    assert [e["update"] for e in read_jsonl(run.responses)] == [0, 0, 2, 2]  # their evaluations' fate
    assert sorted(p.name for p in run.rollouts.iterdir()) == ["update_000000.jsonl", "update_000001.jsonl"]
    assert any("cut short" in n for n in notes) and any("2 update(s) after the checkpoint" in n for n in notes)


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda run: _drop_line(run, 1), "has no line for them"),
        (lambda run: _logged(run, [1]), "logs more than once"),
        (lambda run: run.rollout_file(0).unlink(), "rollouts/ has no file for"),
    ],
    ids=["missing-row", "duplicate-row", "missing-rollouts"],
)
def test_a_gap_below_the_checkpoint_is_refused(run, damage, named):
    _iteration(run, 3)
    _logged(run, range(3))
    damage(run)
    with pytest.raises(UserError, match=named) as err:
        records.resume_point(run, 5)
    assert "checkpoint at update 3" in str(err.value) and "\n" not in str(err.value)


def test_a_complete_iteration_without_its_tracker_is_the_latest_and_the_tracker_is_repaired(run):
    _iteration(run, 2, tracker=False)  # a first save killed between its rename and the tracker write
    assert run.has_checkpoint() and layout.latest_iteration(run.checkpoint) == 2
    _iteration(run, 4)
    _iteration(run, 6, tracker=False)  # a later save killed the same way: the tracker still says 4
    assert layout.latest_iteration_dir(run.checkpoint).name == "iter_0000006"
    _logged(run, range(6))
    assert records.resume_point(run, 8) == 6
    assert layout.read_tracker(run.checkpoint) == 4  # checking writes nothing
    notes = []
    records.repair_tracker(run, notes.append)
    assert layout.read_tracker(run.checkpoint) == 6 and "tracker now does" in notes[0]


def test_a_staging_directory_is_not_a_checkpoint(run):
    (run.checkpoint / "iter_0000002.staging").mkdir(parents=True)
    assert not run.has_checkpoint()
    assert records.resume_point(run, 4) is None


def test_a_damaged_trainer_state_is_one_line(run):
    _iteration(run, 2)
    (run.checkpoint / "iter_0000002" / records.STATE_FILE).write_text("{not json")
    with pytest.raises(UserError, match=r"trainer_state.json is damaged .*remove .*iter_0000002") as err:
        records.resume_point(run, 4)
    assert "\n" not in str(err.value)


def test_a_run_that_has_its_updates_is_refused_only_when_complete(run):
    _iteration(run, 4)
    _logged(run, range(4))
    assert records.resume_point(run, 4) == 4  # killed after its final save: the end stage runs
    mark_complete(run.root)
    with pytest.raises(UserError, match="already has 4 updates"):
        records.resume_point(run, 4)
    with pytest.raises(UserError, match="already has 4 updates"):
        records.resume_point(run, 3)


def test_removing_the_iteration_an_error_names_resumes_from_the_one_before(run):
    _iteration(run, 2)
    _iteration(run, 4)
    _logged(run, range(4))
    (run.checkpoint / "iter_0000004" / records.STATE_FILE).write_text("{not json")
    with pytest.raises(UserError, match=r"remove \S*iter_0000004 to resume from the iteration before it"):
        records.resume_point(run, 6)
    shutil.rmtree(run.checkpoint / "iter_0000004")  # what the error says: the tracker still names it
    assert records.resume_point(run, 6) == 2
    notes = []
    records.repair_tracker(run, notes.append)
    assert layout.read_tracker(run.checkpoint) == 2
    assert notes == [
        "checkpoint: the tracker named iter_0000004, which is gone or incomplete; it now names "
        "iter_0000002, the newest complete iteration"
    ]
    shutil.rmtree(run.checkpoint / "iter_0000002")  # the last one too: the run starts again
    assert not run.has_checkpoint() and records.resume_point(run, 6) is None
