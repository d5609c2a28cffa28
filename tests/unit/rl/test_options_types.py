"""TrainOptions from a TOML file: every value is checked against its option's type, naming the key."""

from __future__ import annotations

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl.options import TrainOptions, read_toml, resolve


@pytest.mark.parametrize(
    "line, named",
    [
        ('updates = "ten"', "updates must be an integer, got 'ten' (str)"),
        ("updates = true", "updates must be an integer, got True (bool)"),
        ('lr = "1e-4"', "lr must be a number or auto, got '1e-4' (str)"),
        ('depths = [2, "3"]', "depths must be a list of integers"),
        ("depths = 3", "depths must be a list of integers, got 3 (int)"),
        ("state_digest = 1", "state_digest must be true or false, got 1 (int)"),
        ("recompute = 1", "recompute must be a string, got 1 (int)"),
        ("keep_last = 1.5", "keep_last must be an integer, got 1.5 (float)"),
        ("eval-data = 7", "eval_data must be a string, got 7 (int)"),
    ],
)
def test_a_value_of_the_wrong_type_is_named(tmp_path, line, named):
    (tmp_path / "c.toml").write_text(line + "\n")
    with pytest.raises(
        UserError, match="^--config .*c.toml: " + named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        read_toml(tmp_path / "c.toml")


def test_an_integer_is_a_number_and_flags_still_override(tmp_path):
    (tmp_path / "c.toml").write_text("lr = 1\nupdates = 5\n[engine]\nmax-num-seqs = 4\n")
    options = resolve({"updates": 7}, str(tmp_path / "c.toml"))
    assert options.trainer.lr == 1.0 and isinstance(options.trainer.lr, float)
    assert options.updates == 7 and options.engine.max_num_seqs == 4


@pytest.mark.parametrize("size", [0, 1])
def test_group_size_zero_and_one_get_the_same_rule(size):
    with pytest.raises(
        UserError, match=f"^--group-size must be at least 2: GRPO normalises rewards within a group, got {size}$"
    ):
        TrainOptions(group_size=size).validate()


def test_save_on_interrupt_takes_three_values():
    assert TrainOptions(save_on_interrupt="on").validate().save_on_interrupt == "on"
    with pytest.raises(UserError, match="--save-on-interrupt must be auto, on or off"):
        TrainOptions(save_on_interrupt="yes").validate()


def test_toml_takes_flat_keys_and_the_trees_sections(tmp_path):
    """Flat keys, any [heading] (as before the tree), the tree's own sections and dotted keys all
    reach the same options; a section's heading must hold that section's options."""
    (tmp_path / "flat.toml").write_text("lr = 0.5\nmax_num_seqs = 3\ntemperature = 0.7\n")
    (tmp_path / "headings.toml").write_text("[optimizer]\nlr = 0.5\n[rollouts]\nmax-num-seqs = 3\ntemperature = 0.7\n")
    (tmp_path / "nested.toml").write_text(
        "[trainer]\nlr = 0.5\n[engine]\nmax_num_seqs = 3\n[sampling]\ntemperature = 0.7\n"
    )
    (tmp_path / "dotted.toml").write_text("trainer.lr = 0.5\nengine.max_num_seqs = 3\nsampling.temperature = 0.7\n")
    for name in ("flat", "headings", "nested", "dotted"):
        options = resolve({}, str(tmp_path / f"{name}.toml"))
        assert (options.trainer.lr, options.engine.max_num_seqs, options.sampling.temperature) == (0.5, 3, 0.7), name
    (tmp_path / "misplaced.toml").write_text("[trainer]\neval_prompts = 3\n")
    with pytest.raises(UserError, match=r"misplaced.toml: eval_prompts is not an option of \[trainer\]"):
        read_toml(tmp_path / "misplaced.toml")


def test_a_recorded_plan_reads_back_into_the_tree():
    """The flat options a plan records (to_dict) build the same tree; an option that does not
    exist (test_break_resume is a test-only variable, OURO_TEST_BREAK_RESUME) is refused."""
    options = resolve({"lr": 0.25, "depths": [3], "max_num_seqs": 5}, None)
    again = TrainOptions.from_dict(options.to_dict()).validate()
    assert again == options and again.trainer.lr == 0.25 and again.engine.max_num_seqs == 5
    with pytest.raises(UserError, match="^ouro-plan.json: unknown option 'test_break_resume'"):
        TrainOptions.from_dict({**options.to_dict(), "test_break_resume": False})


@pytest.mark.parametrize(
    "text, places",
    [
        ("[trainer]\nlr = 1e-4\n[optimizer]\nlr = 2e-4\n", "at [trainer] and at [optimizer]"),
        ("lr = 1e-4\n[trainer]\nlr = 2e-4\n", "at the top level and at [trainer]"),
        ("[rollouts]\nmax_response_len = 8\nmax-response-len = 9\n", "at [rollouts] and at [rollouts]"),
        ("trainer.lr = 1e-4\n[x.trainer]\nlr = 2e-4\n", "at [trainer] and at [x.trainer]"),
    ],
)
def test_an_option_set_twice_is_refused(tmp_path, text, places):
    (tmp_path / "twice.toml").write_text(text)
    name = "max_response_len" if "response" in text else "lr"
    with pytest.raises(UserError) as err:
        read_toml(tmp_path / "twice.toml")
    assert str(err.value) == f"--config {tmp_path / 'twice.toml'}: {name} is set twice, {places}; keep one"
