"""Files shipped inside the package, so that a wheel runs `ouro train` with no arguments.

    tiny/model/       the bundled tiny Ouro, an HF directory (115k parameters, T = 4 loops,
                      exit gate, a `tokenizers` tokenizer with a ChatML chat template)
    tiny/train.jsonl  its arithmetic task: training prompts
    tiny/eval.jsonl   held-out prompts (no problem shared with train.jsonl)
    tiny/SHA256SUMS   sha256 of every file above (`sha256sum -c SHA256SUMS` inside tiny/)

These are `ouro train`'s defaults (ouro_cli/rl/options.py), listed as package data in
pyproject.toml. `python examples/tiny/generate.py` rewrites them bit for bit.
"""

from pathlib import Path

TINY = Path(__file__).resolve().parent / "tiny"
