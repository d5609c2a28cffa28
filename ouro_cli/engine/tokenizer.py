"""Text in and out of the engine, when the checkpoint ships a tokenizer.

The engine works on token ids. A checkpoint directory with `tokenizer.json` gets a
`tokenizers.Tokenizer` (fast, no remote code); a caller may also pass any object
with Hugging Face-style `encode`/`decode`. Prompts are encoded without added special
tokens (chat templating is the caller's job); outputs are decoded without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TextCodec:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, path: str | Path) -> TextCodec | None:
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            return None
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(file)))

    def encode(self, text: str) -> list[int]:
        out = self.tokenizer.encode(text, add_special_tokens=False)
        return list(out.ids if hasattr(out, "ids") else out)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
