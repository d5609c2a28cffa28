"""Write the recipe's training and held-out files from the public DeepScaleR and MATH-500 data.

    python examples/ouro-1.4b/prepare_data.py --deepscaler deepscaler.parquet --math500 math500.jsonl --out data

Inputs, as published (download them yourself; nothing here touches a hub):
- DeepScaleR's training set in verl's Parquet layout: `prompt` (chat messages), `reward_model.
  ground_truth`, `extra_info.index`; or the plain DeepScaleR-Preview layout (`problem`,
  `answer`), with `--deepscaler-layout plain`;
- MATH-500 (`problem`, `answer`, `unique_id`), JSONL or Parquet.

Both are read through ouro's own column mapping (`ouro_cli.rl.data`, the one `--prompt-key`
and friends use), so a row the mapping cannot read is named `file:row` here exactly as
`ouro train` would name it. The output is ouro's JSONL schema, one row per problem:
`{"prompt": ..., "label": ..., "metadata": {"problem_id": ...}}`, with DeepScaleR's
instruction appended to plain-text problems ("Let's think step by step and output the final
answer within \\boxed{}."), as DeepScaleR's own preprocessing does. `ouro train` could read
the verl Parquet directly with `--label-key reward_model.ground_truth --id-key
extra_info.index`; the JSONL is what the recipe names so that both files look alike and can
be read by a person.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ouro_cli.rl.data import Columns, load_dataset

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
LAYOUTS = {
    "verl": Columns(prompt="prompt", label="reward_model.ground_truth", id="extra_info.index"),
    "plain": Columns(prompt="problem", label="answer"),  # no ids: rows are numbered
}
MATH500 = Columns(prompt="problem", label="answer", id="unique_id")


def rows_of(path: str, columns: Columns, prefix: str) -> list[dict]:
    out = []
    for row in load_dataset(path, columns):
        prompt = row.prompt if row.is_chat else f"{row.prompt} {INSTRUCTION}"
        if row.is_chat:
            prompt = [dict(m) for m in prompt]
        out.append({"prompt": prompt, "label": row.label, "metadata": {"problem_id": f"{prefix}-{row.problem_id}"}})
    return out


def write(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{path}: {len(rows)} rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepscaler", required=True, help="DeepScaleR training data (Parquet or JSONL)")
    parser.add_argument("--deepscaler-layout", choices=sorted(LAYOUTS), default="verl")
    parser.add_argument("--math500", required=True, help="MATH-500 (JSONL or Parquet)")
    parser.add_argument("--out", default="data", help="folder for deepscaler.jsonl and math500.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "deepscaler.jsonl", rows_of(args.deepscaler, LAYOUTS[args.deepscaler_layout], "deepscaler"))
    write(out / "math500.jsonl", rows_of(args.math500, MATH500, "math500"))


if __name__ == "__main__":
    main()
