"""Prompt templates: how a data row's prompt becomes the text the engine tokenises.

- `chatml` (default): Ouro's chat format. A string prompt is one user message; a message
  list is rendered message by message; the assistant turn is opened for generation:

      <|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n

  `<|im_start|>` and `<|im_end|>` are token ids 1 and 2 of the Ouro tokenizer
  (docs/model.md §1), so the rendered text tokenises to exactly those control tokens.
- `raw`: a string prompt is used as is (a base model continuing a plain-text prompt);
  chat-message prompts are refused, because there is no honest way to flatten them.
- `tokenizer`: the chat template that ships with the checkpoint's tokenizer
  (`tokenizer.apply_chat_template(..., add_generation_prompt=True)`); its Jinja text is
  what the plan records.

A chat message's role must be one the template knows (`roles`): ChatML's system, user and
assistant, and for `tokenizer` also any role its Jinja text compares a message's role
with (`tool`, say). Another role would render as text the model never saw in that place.

Every template has a name and a full `text` that the run plan records (`plan_entry`),
so `ouro resume` can tell that the prompts are rendered the same way. The `chatml` text
is the Jinja chat template that renders identically to `render` (a test checks this
with jinja2), so the record is also a working template.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError

DEFAULT_TEMPLATE = "chatml"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

CHATML_JINJA = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
RAW_TEXT = "{{ prompt }}"
CHATML_ROLES = ("system", "user", "assistant")
_ROLE_TEST = re.compile(r"""role['"]?\]?\s*==\s*['"]([^'"]+)['"]""")  # message['role'] == 'user', message.role == "x"

Prompt = str | Sequence[dict[str, str]]


def as_messages(prompt: Prompt) -> list[dict[str, str]]:
    """A prompt as chat messages: a string is a single user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    text: str
    tokenizer: Any = field(default=None, compare=False, repr=False)

    def render(self, prompt: Prompt) -> str:
        if self.name == "chatml":
            turns = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in as_messages(prompt))
            return turns + f"{IM_START}assistant\n"
        if self.name == "raw":
            if not isinstance(prompt, str):
                raise UserError(
                    "the 'raw' prompt template takes string prompts only; "
                    "use --prompt-template chatml for chat-message prompts"
                )
            return prompt
        if self.name == "tokenizer":
            return self.tokenizer.apply_chat_template(as_messages(prompt), tokenize=False, add_generation_prompt=True)
        raise AssertionError(self.name)

    @property
    def roles(self) -> tuple[str, ...]:
        """The chat roles this template renders (none for `raw`, which takes strings only)."""
        if self.name == "raw":
            return ()
        if self.name == "tokenizer":
            return tuple(dict.fromkeys([*CHATML_ROLES, *_ROLE_TEST.findall(self.text)]))
        return CHATML_ROLES

    def check(self, prompts: Sequence[tuple[str, Prompt]]) -> None:
        """Fail up front, naming the location, for a prompt this template cannot render: chat
        messages under `raw`, or a role the template does not know."""
        for where, prompt in prompts:
            if isinstance(prompt, str):
                continue
            if self.name == "raw":
                raise UserError(
                    f"{where}: the 'raw' prompt template takes string prompts only, this row has "
                    "chat messages; use --prompt-template chatml"
                )
            for i, message in enumerate(prompt):
                if message["role"] not in self.roles:
                    raise UserError(
                        f"{where}: message {i} has the role {message['role']!r}, which the "
                        f"{self.name} prompt template does not know; use one of {', '.join(self.roles)}"
                    )

    def plan_entry(self) -> dict[str, str]:
        return {"name": self.name, "text": self.text, "sha256": hashlib.sha256(self.text.encode()).hexdigest()}


def get_template(name: str = DEFAULT_TEMPLATE, tokenizer: Any = None) -> PromptTemplate:
    """The template called `name` ("chatml", "raw", or "tokenizer", which needs `tokenizer`)."""
    if name == "chatml":
        return PromptTemplate("chatml", CHATML_JINJA)
    if name == "raw":
        return PromptTemplate("raw", RAW_TEXT)
    if name == "tokenizer":
        chat_template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise UserError(
                "--prompt-template tokenizer: the model's tokenizer has no chat_template; use chatml or raw"
            )
        return PromptTemplate("tokenizer", chat_template, tokenizer)
    raise UserError(f"unknown prompt template {name!r}; choose chatml (default), raw or tokenizer")


def template_for_checkpoint(name: str, assets_dir: str | Path) -> PromptTemplate:
    """The template called `name` for the checkpoint whose tokenizer files are in `assets_dir`
    (its HF directory, or a Megatron checkpoint's hf_assets/): "tokenizer" loads that
    tokenizer, for its chat template; the other templates do not need it.

    The tokenizer is loaded as the fast tokenizer of its tokenizer.json (the file the engine
    tokenises with), not through AutoTokenizer: an Ouro config.json names remote code
    (`auto_map`), and AutoTokenizer would stop to ask whether to trust it."""
    tokenizer = None
    if name == "tokenizer":
        # imported only here: importing transformers takes seconds
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(assets_dir))
    return get_template(name, tokenizer)


TEMPLATE_NAMES = ("chatml", "raw", "tokenizer")

__all__ = [
    "CHATML_JINJA",
    "CHATML_ROLES",
    "DEFAULT_TEMPLATE",
    "PromptTemplate",
    "TEMPLATE_NAMES",
    "as_messages",
    "get_template",
    "template_for_checkpoint",
]
