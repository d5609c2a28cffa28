"""`ouro-plan.json`: the run's contract, and where the run stands.

The contract is everything that decides what a run computes: the depth schedule, seeds,
sampling, reward, template, batch and group sizes, response length, the optimizer, the
engine settings, the memory plan's batch sizes (`sizing`: KV blocks, sequences in flight,
micro-batch tokens, recompute), the kernels and compilation as they resolve on the run's
device (`execution`, ouro_cli/settings.py `effective`), and the sha256 of the data, the
model config and the tokenizer. It is
written when a run starts and again, atomically, inside every checkpoint (before the
checkpoint commits) and beside it, with `next_update` and the data cursor. `ouro resume`
rebuilds the options from the plan and rejects any flag that would change the contract,
naming the key; the cursor saved in the checkpoint must agree with the plan's.

Options outside the contract may change on resume: the number of updates, evaluation
and save cadence, export, keep-last, save-on-interrupt, the reward's time limit, where
tensors live and how PD workers move them (and the LR schedule with `--override-scheduler`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from ouro_cli.artifacts import write_json_atomic
from ouro_cli.config import leaves
from ouro_cli.errors import UserError
from ouro_cli.settings import ExecutionSettings, from_environment, variables

from .options import TrainOptions

PLAN_VERSION = 1

# may differ between a run and its resumption
FREE_KEYS = {
    "updates",
    "run_dir",
    "data",
    "save_interval",
    "keep_last",
    "eval_data",
    "eval_prompts",
    "eval_samples",
    "eval_interval",
    "eval_depths",
    "export_hf",
    "plot",
    "overwrite",
    "model",
    "state_digest",
    "save_on_interrupt",
    "gpu_memory_utilization",  # the memory plan it yields is recorded (contract "sizing") and reused
    "async_save",
    "offload_optimizer",
    "loggers",  # where tensors live, what is logged
    "wandb_project",
    "wandb_entity",
    "wandb_name",
    "wandb_tags",  # where --logger wandb files the run
    "kv_transport",
    "pd_worker_threads",  # how PD workers move bytes; their host threads
    "eval_prompt_key",
    "eval_label_key",
    "eval_id_key",
    "eval_label_parser",  # like eval_data
    "reward_timeout",
}  # changes no reward: a call past it stops the run
EXECUTION_KEYS = set(leaves(ExecutionSettings))  # recorded as what they resolve to (contract "execution")
SCHEDULER_KEYS = {"lr", "lr_schedule", "warmup_steps", "min_lr", "lr_decay_updates"}


def file_sha256(path: Path | None) -> str | None:
    if path is None or not Path(path).is_file():
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_contract(
    options: TrainOptions,
    *,
    data_sha256: str,
    model_config: dict[str, Any],
    tokenizer_sha256: str | None,
    template: dict[str, str],
    num_loops: int,
) -> dict[str, Any]:
    contract = {k: v for k, v in options.to_dict().items() if k not in FREE_KEYS | EXECUTION_KEYS}
    contract.update(
        execution=options.execution.effective(options.trainer.resolved_device),
        data_sha256=data_sha256,
        model_config_sha256=hashlib.sha256(json.dumps(model_config, sort_keys=True).encode()).hexdigest(),
        tokenizer_sha256=tokenizer_sha256,
        template=template,
        prefill_depth=num_loops,
    )
    return contract


def contract_hash(contract: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(contract, sort_keys=True).encode()).hexdigest()


def sizing_entry(sizing) -> dict[str, Any]:
    """The part of the run's memory plan (rl/sizing.py) that decides what it computes: decode
    batch composition and micro-batch splits (summation order). A resumed run reuses it."""
    return {
        key: getattr(sizing, key)
        for key in (
            "kv_blocks",
            "max_num_seqs",
            "max_tokens_per_micro_batch",
            "recompute",
            "token_cost",
            "prompt_heads",
            "deep_parts_first",
        )
    }


def new_plan(
    options: TrainOptions, contract: dict[str, Any], cursor: dict[str, Any], sizing: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "plan_version": PLAN_VERSION,
        "contract": contract,
        "options": options.to_dict(),
        "given_paths": options.given_paths,
        "next_update": 0,
        "cursor": cursor,
        "sizing": sizing,
    }


def advance(plan: dict[str, Any], next_update: int, cursor: dict[str, Any], updates: int) -> dict[str, Any]:
    return {**plan, "next_update": next_update, "cursor": cursor, "options": {**plan["options"], "updates": updates}}


def write_plan(path: Path, plan: dict[str, Any]) -> None:
    write_json_atomic(Path(path), plan)


def read_plan(path: Path) -> dict[str, Any]:
    path = Path(path)
    try:
        plan = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise UserError(f"{path.parent} is not an ouro run directory (no {path.name})") from err
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON: {err}") from err
    if plan.get("plan_version") != PLAN_VERSION or "contract" not in plan:
        raise UserError(f"{path} is not an ouro plan of version {PLAN_VERSION}")
    return plan


def resume_options(plan: dict[str, Any], given: dict[str, Any], *, updates: int, run_dir: str) -> TrainOptions:
    """The options of a resumed run: the plan's, then the flags given (None: not given). Flags
    that would change the contract are refused later, by `check_same_contract`, once the
    contract of this invocation is known. Paths given now are relative to the working
    directory; the plan's are absolute, and their
    originals, as the run was started with them, are kept for messages (`given_paths`)."""
    values = dict(plan["options"])
    values.update(from_environment(TrainOptions))  # a variable that is set stands in for a flag given
    values.update({k: v for k, v in given.items() if v is not None})
    values.update(updates=updates, run_dir=run_dir, overwrite=False)
    recorded = {k: v for k, v in plan.get("given_paths", {}).items() if given.get(k) is None}
    options = TrainOptions.from_dict(values).validate()
    return dataclasses.replace(options, given_paths=recorded).absolute()


# Execution settings whose absence from a recorded plan has one meaning: the plan was written
# before the setting existed, when every run computed so (no fp8 KV cache: the model's dtype).
EXECUTION_BEFORE_THE_KEY = {"kv_cache_dtype": "model"}
# The same for the contract's own keys (the engine shared a group's prompt before it could be
# turned off).
CONTRACT_BEFORE_THE_KEY = {"share_prompts": True}


def check_same_contract(saved: dict[str, Any], new: dict[str, Any], *, allow_scheduler: bool) -> None:
    """Reject a resume whose contract differs from the run's, naming the first differing key (a
    setting of `execution` or `sizing` by its own name). A recorded `execution` lacking a key of
    EXECUTION_BEFORE_THE_KEY reads as that key's value there, and so does a contract lacking a
    key of CONTRACT_BEFORE_THE_KEY."""
    for key in sorted(set(saved) | set(new)):
        if allow_scheduler and key in SCHEDULER_KEYS:
            continue
        a, b = saved.get(key, CONTRACT_BEFORE_THE_KEY.get(key)), new.get(key)
        if key == "execution" and isinstance(a, dict):
            a = {**EXECUTION_BEFORE_THE_KEY, **a}
        if a == b:
            continue
        if key in ("execution", "sizing") and isinstance(a, dict) and isinstance(b, dict):
            differ = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            part = "exact" if "exact" in differ else differ[0]  # it changes the others: name the cause
            hint = ""
            if key == "execution":
                flag = leaves(ExecutionSettings)[part].flag
                variable = variables(ExecutionSettings).get(part)
                hint = f" (set by {flag}{f' or {variable}' if variable else ''}; resume with the run's)"
            raise UserError(
                f"resume would change {key}.{part}: the run has {a.get(part)!r}, this invocation {b.get(part)!r}{hint}"
            )
        hint = " (pass --override-scheduler to change the LR schedule)" if key in SCHEDULER_KEYS else ""
        raise UserError(f"resume would change {key}: the run has {a!r}, this invocation {b!r}{hint}")


def check_cursor(plan: dict[str, Any], checkpoint_extra: dict[str, Any]) -> None:
    """The checkpoint's saved cursor and update must be the ones the plan recorded with it."""
    if checkpoint_extra.get("next_update") != plan["next_update"]:
        raise UserError(
            f"the checkpoint continues at update {checkpoint_extra.get('next_update')} but the plan says "
            f"{plan['next_update']}: the run directory is inconsistent"
        )
    if checkpoint_extra.get("cursor") != plan["cursor"]:
        raise UserError(
            f"the checkpoint's data cursor {checkpoint_extra.get('cursor')} disagrees with the plan's "
            f"{plan['cursor']}: the run directory is inconsistent"
        )
