"""Prompts as the engine gets them, shared by `ouro train` (loop.py), `ouro eval` (evaluate.py)
and `ouro data check --model`: rendered by the run's template, tokenised, checked against
the sequence limit; and the token ids that end a response."""

from __future__ import annotations

from ouro_cli.errors import UserError

from .data import Row


def tokenize_prompts(
    codec, template, rows: list[Row], limit: int, max_response_len: int, where: str
) -> list[list[int]]:
    """Each row's prompt as token ids; a prompt the template cannot render (template.py
    `check`), one that renders to nothing, or one that leaves no room for `max_response_len`
    tokens within `limit`, is a UserError naming `where`:line. `ouro data check --model`
    validates with this too, so it refuses what a run refuses."""
    template.check([(f"{where}:{row.line}", row.prompt) for row in rows])
    ids = []
    for row in rows:
        tokens = codec.encode(template.render(row.prompt))
        if not tokens:
            raise UserError(f"{where}:{row.line}: the prompt renders to no tokens")
        if len(tokens) + max_response_len > limit:
            raise UserError(
                f"{where}:{row.line}: prompt of {len(tokens)} tokens + --max-response-len "
                f"{max_response_len} exceeds the sequence limit {limit}"
            )
        ids.append(tokens)
    return ids


def stop_tokens_for(config, codec) -> list[int]:
    """The model's EOS id(s) and, when the tokenizer has it, ChatML's `<|im_end|>`."""
    from ouro_cli.engine.setup import eos_token_ids

    stops = list(eos_token_ids(config))
    im_end = codec.tokenizer.token_to_id("<|im_end|>") if hasattr(codec.tokenizer, "token_to_id") else None
    if im_end is not None:
        stops.append(im_end)
    return sorted(set(stops))
