"""Prompt templates: the default ChatML rendering, raw prompts, and the recorded template text."""

from __future__ import annotations

import pytest

from ouro_cli.errors import UserError
from ouro_cli.rl.template import CHATML_JINJA, DEFAULT_TEMPLATE, get_template

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


def test_default_is_chatml_and_renders_strings_and_messages():
    assert DEFAULT_TEMPLATE == "chatml"
    t = get_template()
    assert t.render("What is 2+3?") == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert t.render(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_recorded_chatml_text_is_a_working_jinja_template():
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(CHATML_JINJA)
    t = get_template("chatml")
    for prompt in ("hi", MESSAGES):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        assert template.render(messages=messages, add_generation_prompt=True) == t.render(prompt)


def test_raw_template():
    t = get_template("raw")
    assert t.render("Question: 1+1=") == "Question: 1+1="
    with pytest.raises(UserError, match="string prompts only"):
        t.render(MESSAGES)
    with pytest.raises(UserError, match=r"data.jsonl:4: the 'raw' prompt template"):
        t.check([("data.jsonl:3", "ok"), ("data.jsonl:4", MESSAGES)])
    get_template("chatml").check([("data.jsonl:4", MESSAGES)])


def test_plan_entry_records_name_and_full_text():
    entry = get_template("chatml").plan_entry()
    assert entry["name"] == "chatml" and entry["text"] == CHATML_JINJA and len(entry["sha256"]) == 64
    assert get_template("raw").plan_entry()["text"] != entry["text"]


class JinjaTokenizer:
    """The part of a transformers tokenizer that chat templating uses, rendered with jinja2 as HF does."""

    def __init__(self, chat_template):
        self.chat_template = chat_template

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        import jinja2

        assert tokenize is False
        return (
            jinja2.Environment()
            .from_string(self.chat_template)
            .render(messages=messages, add_generation_prompt=add_generation_prompt)
        )


def test_tokenizer_template():
    pytest.importorskip("jinja2")
    custom = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    t = get_template("tokenizer", JinjaTokenizer(custom))
    assert t.render("hi") == "[user] hi\n[assistant] "
    assert t.plan_entry()["text"] == custom
    with pytest.raises(UserError, match="no chat_template"):
        get_template("tokenizer", JinjaTokenizer(None))
    with pytest.raises(UserError, match="no chat_template"):
        get_template("tokenizer", None)


def test_real_transformers_tokenizer_if_installed():
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "[UNK]": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.chat_template = CHATML_JINJA
    assert get_template("tokenizer", tok).render(MESSAGES) == get_template("chatml").render(MESSAGES)


def test_unknown_template():
    with pytest.raises(UserError, match="unknown prompt template 'alpaca'"):
        get_template("alpaca")


def test_a_role_the_template_does_not_know_is_refused_naming_the_row():
    wizard = [{"role": "system", "content": "Be brief."}, {"role": "wizard", "content": "2+3?"}]
    with pytest.raises(UserError) as err:
        get_template("chatml").check([("data.jsonl:3", MESSAGES), ("data.jsonl:4", wizard)])
    assert str(err.value) == (
        "data.jsonl:4: message 1 has the role 'wizard', which the chatml prompt template does "
        "not know; use one of system, user, assistant"
    )


def test_a_tokenizer_template_knows_chatmls_roles_and_those_it_names():
    qwen_like = "{% for m in messages %}{% if m.role == \"tool\" %}<tool>{% endif %}{{ m['content'] }}{% endfor %}"
    assert get_template("tokenizer", JinjaTokenizer(qwen_like)).roles == ("system", "user", "assistant", "tool")
    assert get_template("tokenizer", JinjaTokenizer(CHATML_JINJA)).roles == ("system", "user", "assistant")
    assert get_template("raw").roles == ()
