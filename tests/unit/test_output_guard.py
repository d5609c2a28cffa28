"""The one output guard (ouro_cli.artifacts): no output may equal, contain or lie inside an
input, it must be writable, and --overwrite empties only what is not an input."""

from __future__ import annotations

from pathlib import Path

import pytest

from ouro_cli import artifacts
from ouro_cli.errors import UserError


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text("{}\n")
    return [tmp_path / "model", tmp_path / "data.jsonl"]


@pytest.mark.parametrize("out", ["model", "model/sub", ".", "data.jsonl"], ids=["equal", "inside", "contains", "file"])
def test_an_output_overlapping_an_input_is_refused_even_with_overwrite(tmp_path, inputs, out):
    with pytest.raises(UserError, match="overlaps the input") as err:
        artifacts.check_output_dir(tmp_path / out, overwrite=True, inputs=inputs)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="overlaps the input"), artifacts.staged_output(
            tmp_path / out, overwrite=True, inputs=inputs):
        pass
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "data.jsonl").is_file()


def test_a_sibling_output_is_fine_and_overwrite_replaces_it(tmp_path, inputs):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        artifacts.check_output_dir(out, overwrite=False, inputs=inputs)
    with artifacts.staged_output(out, overwrite=True, inputs=inputs) as staging:
        (staging / "new").write_text("y")
    assert sorted(p.name for p in out.iterdir()) == ["new"]


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs /sys (not writable even for root)")
def test_an_unwritable_output_is_found_before_anything_is_written():
    # permission bits mean nothing to root: the probe creates a directory for real
    with pytest.raises(UserError, match="cannot be written .*choose a writable directory"):
        artifacts.check_output_dir(Path("/sys/ouro-test-output"), overwrite=False)


def test_an_output_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is not a directory"):
        artifacts.check_output_dir(tmp_path / "f", overwrite=True)
    with pytest.raises(UserError, match="cannot be created"):
        artifacts.check_output_dir(tmp_path / "f" / "out", overwrite=True)


def test_clear_dir_keeps_only_what_it_is_told(tmp_path):
    for name in ("a", "ouro.lock"):
        (tmp_path / name).write_text(name)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    artifacts.clear_dir(tmp_path, keep=["ouro.lock"])
    assert [p.name for p in tmp_path.iterdir()] == ["ouro.lock"]
