"""What an exported policy was trained with, where that changes the function it is.

A run saves its plan (rl/plan.py) into every checkpoint iteration, and the plan's contract
records the execution settings as they resolved. One of them changes the function the
policy computes, not only how fast: an fp8 KV cache (`--kv-cache-dtype fp8`), under which
every layer rounded its K/V to fp8 in the rollouts and in the trainer's replay alike
(model/kv_quant.py). The weights of such a run are the weights of that rounded model; run
without the rounding (in transformers, or with an unquantized cache) they compute a nearby
but different policy. An export or conversion of such a checkpoint says so: in a README.md
beside the weights and in its manifest (`trained_with`), so that an evaluation can run it as
trained (`ouro eval --kv-cache-dtype fp8`).
"""

from __future__ import annotations

import json
from pathlib import Path

from .layout import PLAN

README = "README.md"

NOTE = """# Trained with an fp8 KV cache

This policy was trained by `ouro train --kv-cache-dtype fp8`: in every layer call its keys and
values were rounded to float8 e4m3, with a power-of-two scale per token and KV head, in the
rollouts and in the trainer alike (ouro's docs/model.md §3, "An fp8 KV cache"). Its weights are
those of that rounded model. To evaluate the policy it was trained as, run it with the same
cache:

    ouro eval THIS_DIRECTORY --data eval.jsonl --kv-cache-dtype fp8

Without the rounding (in transformers, or with an unquantized cache) the same weights compute
a nearby but different policy.
"""


def trained_with(checkpoint_dir: Path) -> dict[str, str]:
    """The settings that changed the function a checkpoint iteration was trained as, from the
    plan it holds: {"kv_cache_dtype": "fp8"} or nothing (also for a checkpoint no run saved)."""
    try:
        plan = json.loads((Path(checkpoint_dir) / PLAN).read_text())
    except (OSError, ValueError):
        return {}
    execution = plan.get("contract", {}).get("execution", {}) if isinstance(plan, dict) else {}
    return {"kv_cache_dtype": "fp8"} if execution.get("kv_cache_dtype") == "fp8" else {}


def write_note(out_dir: Path, trained: dict[str, str]) -> list[str]:
    """The README an export of a checkpoint trained with `trained` carries (none when it is
    empty) -> the files written."""
    if trained.get("kv_cache_dtype") != "fp8":
        return []
    (Path(out_dir) / README).write_text(NOTE)
    return [README]
