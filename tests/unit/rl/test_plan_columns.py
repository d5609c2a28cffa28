"""The column mapping is part of a run's contract: what `--data` yields depends on it as much as
on the file's bytes. The held-out mapping is free, like `--eval-data` itself."""

from __future__ import annotations

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl import plan as plans
from ouro_cli.rl.data import Columns, columns_for
from ouro_cli.rl.options import TrainOptions, resolve


def contract(**options):
    return plans.build_contract(
        TrainOptions.from_dict(options),
        data_sha256="d" * 64,
        model_config={"x": 1},
        tokenizer_sha256=None,
        template={"name": "chatml"},
        num_loops=4,
    )


def test_the_mapping_of_data_is_in_the_contract_and_a_change_is_named():
    saved = contract(
        prompt_key="problem", label_key="reward_model.ground_truth", id_key="extra_info.index", label_parser="gsm8k"
    )
    assert (saved["prompt_key"], saved["label_key"], saved["id_key"], saved["label_parser"]) == (
        "problem",
        "reward_model.ground_truth",
        "extra_info.index",
        "gsm8k",
    )
    for change in ({"prompt_key": "question"}, {"label_key": "answer"}, {"id_key": "uid"}, {"label_parser": "none"}):
        new = contract(
            **{
                "prompt_key": "problem",
                "label_key": "reward_model.ground_truth",
                "id_key": "extra_info.index",
                "label_parser": "gsm8k",
                **change,
            }
        )
        (key,) = change
        with pytest.raises(UserError, match=f"^resume would change {key}: "):
            plans.check_same_contract(saved, new, allow_scheduler=False)


def test_the_mapping_of_eval_data_is_free():
    saved = contract()
    plans.check_same_contract(
        saved,
        contract(
            eval_prompt_key="problem", eval_label_key="answer", eval_id_key="unique_id", eval_label_parser="gsm8k"
        ),
        allow_scheduler=False,
    )


def test_a_plan_without_the_mapping_is_refused_naming_it():
    """A contract is compared as it was recorded: a key it lacks is not filled in with a default."""
    new = contract()
    old = {k: v for k, v in new.items() if k not in ("prompt_key", "label_key", "id_key", "label_parser")}
    with pytest.raises(UserError, match="^resume would change id_key: the run has None, this invocation "):
        plans.check_same_contract(old, new, allow_scheduler=False)


def test_options_defaults_are_the_loaders_and_eval_inherits_from_data():
    options = TrainOptions()
    assert columns_for(options) == Columns() == columns_for(options, held_out=True)
    options = TrainOptions.from_dict(
        dict(
            eval_data="held_out.jsonl",  # an eval set of the user's (the bundled one keeps its own mapping)
            prompt_key="problem",
            label_key="answer",
            label_parser="gsm8k",
            eval_label_key="solution",
            eval_label_parser="none",
        )
    )
    assert columns_for(options) == Columns("problem", "answer", Columns.id, "gsm8k")
    assert columns_for(options, held_out=True) == Columns("problem", "solution", Columns.id, "none")


def test_mapping_options_are_validated_and_come_from_toml(tmp_path):
    with pytest.raises(UserError, match="^--label-parser must be one of none, gsm8k, got 'gsm'$"):
        TrainOptions.from_dict({"label_parser": "gsm"})
    with pytest.raises(UserError, match="^--eval-id-key must name a field"):
        TrainOptions.from_dict({"eval_id_key": ""})
    (tmp_path / "c.toml").write_text('[data]\nprompt-key = "question"\nlabel_key = "answer"\nlabel_parser = "gsm8k"\n')
    options = resolve({"label_key": "final"}, str(tmp_path / "c.toml"))
    assert (options.columns.prompt_key, options.columns.label_key, options.columns.label_parser) == (
        "question",
        "final",
        "gsm8k",
    )


def test_the_bundled_held_out_set_keeps_its_own_mapping(tmp_path):
    """`--data` with another layout leaves the bundled held-out set read through our schema; an
    explicit eval mapping flag still applies to it."""
    from ouro_cli.rl.data import is_bundled_eval, load_held_out
    from ouro_cli.rl.options import BUNDLED

    options = TrainOptions.from_dict({"label_key": "reward_model.ground_truth", "id_key": "extra_info.index"})
    assert is_bundled_eval(options.eval_data)
    assert columns_for(options, held_out=True) == Columns()
    rows = load_held_out(options)
    assert len(rows) == 200 and rows[0].label == 2 and rows[0].problem_id == "eval-000000"
    options = TrainOptions.from_dict({"label_key": "answer", "eval_id_key": "uid"})
    assert columns_for(options, held_out=True) == Columns(id="uid")
    copied = tmp_path / "eval.jsonl"  # the same rows elsewhere are another held-out set
    copied.write_bytes((BUNDLED / "eval.jsonl").read_bytes())
    assert not is_bundled_eval(copied) and not is_bundled_eval("") and not is_bundled_eval(None)


def test_a_bad_held_out_row_names_the_held_out_set_and_its_flags(tmp_path):
    from ouro_cli.rl.data import load_held_out

    held_out = tmp_path / "math500.jsonl"
    held_out.write_text('{"problem": "1+1?", "answer": "2"}\n')
    options = TrainOptions.from_dict(
        {"prompt_key": "problem", "label_key": "reward_model.ground_truth", "eval_data": str(held_out)}
    )
    with pytest.raises(UserError) as info:
        load_held_out(options)
    message = str(info.value)
    assert message.startswith(f'the held-out set --eval-data: {held_out}:1: missing "reward_model.ground_truth"')
    assert "--eval-label-key" in message and "another --eval-data" in message and "\n" not in message
    options = TrainOptions.from_dict(
        {"prompt_key": "problem", "label_key": "x", "eval_data": str(held_out), "eval_label_key": "answer"}
    )
    assert [r.label for r in load_held_out(options)] == ["2"]
    assert load_held_out(TrainOptions.from_dict({"eval_data": ""})) == []
