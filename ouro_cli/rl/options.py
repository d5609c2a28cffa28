"""`TrainOptions`: every option of `ouro train`, typed, defaulted and validated in one place.

The CLI maps its flags onto these fields; a TOML `--config` file may set any of them
(flags given on the command line override it). The resolved options are recorded in
the run's manifest, and the subset that defines the run's contract goes into
`ouro-plan.json` (see plan.py), which `ouro resume` holds the run to.

Options that belong to execution modes not built yet fail loudly instead of being
ignored (`NOT_SUPPORTED_YET`).
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ouro_cli.errors import UserError

BUNDLED = Path(__file__).resolve().parents[2] / "examples" / "tiny"

# option -> the execution mode it would turn on; each must stay at its default for now
NOT_SUPPORTED_YET = {
    "cuda_graphs": "CUDA-graph decoding",
    "async_scheduling": "asynchronous delayed-exit scheduling",
    "speculative_tokens": "self-speculative decoding",
    "prefill_devices": "prefill/decode disaggregation",
    "decode_devices": "prefill/decode disaggregation",
}


@dataclass
class TrainOptions:
    # ---- what to train on --------------------------------------------------------
    model: str = str(BUNDLED / "model")
    data: str = str(BUNDLED / "train.jsonl")
    run_dir: str | None = None
    prompt_template: str = "chatml"
    reward_function: str = "ouro_cli.rl.rewards.boxed_answer"

    # ---- the GRPO update ---------------------------------------------------------
    updates: int = 8
    depths: list[int] = field(default_factory=lambda: [2, 3, 4])
    prompts_per_update: int = 16
    group_size: int = 8
    temperature: float = 1.0
    max_response_len: int = 48
    seq_length: int | None = None  # prompt + response limit; None: the model's max positions
    max_position_embeddings: int | None = None  # must match the model when given
    exit_threshold: float = 1.0
    min_loops: int = 1
    seed: int = 1234

    # ---- optimizer ---------------------------------------------------------------
    lr: float = 2e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    clip_grad: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    aggregation: str = "token_mean"
    micro_batch_size: int | None = None
    recompute: bool = False
    use_distributed_optimizer: bool = False

    # ---- engine ------------------------------------------------------------------
    engine: str = "ouro_cli.engine.factory:default_factory"
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 32
    kv_blocks: int | None = None
    block_size: int = 16
    cuda_graphs: bool = False
    async_scheduling: bool = False
    speculative_tokens: int = 0
    prefill_devices: list[int] = field(default_factory=list)
    decode_devices: list[int] = field(default_factory=list)

    # ---- saving, evaluation, export ---------------------------------------------
    save_interval: int = 0  # 0: only at the end
    keep_last: int | None = 2
    eval_data: str | None = str(BUNDLED / "eval.jsonl")
    eval_prompts: int = 64
    eval_interval: int = 0  # 0: before the first and after the last update only
    eval_depths: list[int] = field(default_factory=lambda: [2, 3, 4])
    export_hf: str | None = None
    overwrite: bool = False
    state_digest: bool = False  # sha256 of model + optimizer state per update (verify-resume)
    test_break_resume: bool = False  # test-only: reseed the sampler after a resume (must be caught)

    def validate(self) -> TrainOptions:
        defaults = TrainOptions()
        for name, what in NOT_SUPPORTED_YET.items():
            if getattr(self, name) != getattr(defaults, name):
                raise UserError(f"--{name.replace('_', '-')}: {what} is not supported yet")
        positive = ("updates", "prompts_per_update", "group_size", "max_response_len", "max_num_seqs",
                    "block_size", "eval_prompts")
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise UserError("--group-size must be at least 2: GRPO normalises rewards within a group")
        if not self.temperature > 0:
            raise UserError("--temperature must be > 0 (GRPO samples; processed logprobs need T > 0)")
        if not 0 < self.exit_threshold <= 1:
            raise UserError("--exit-threshold must lie in (0, 1]")
        if self.save_interval < 0 or self.eval_interval < 0:
            raise UserError("--save-interval and --eval-interval must be >= 0")
        if not self.lr > 0:
            raise UserError("--lr must be > 0")
        if self.lr_schedule not in ("constant", "cosine"):
            raise UserError("--lr-schedule must be constant or cosine")
        if self.aggregation not in ("token_mean", "sequence_mean"):
            raise UserError("--aggregation must be token_mean or sequence_mean")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserError("--device must be auto, cpu or cuda")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise UserError("--dtype must be auto, fp32 or bf16")
        if self.keep_last is not None and self.keep_last < 1:
            raise UserError("--keep-last must be at least 1")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def option_names() -> set[str]:
    return {f.name for f in fields(TrainOptions)}


def read_toml(path: str | Path) -> dict[str, Any]:
    """Options from a TOML file: top-level keys named like the flags (dashes or underscores)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as err:
        raise UserError(f"--config {path} does not exist") from err
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"--config {path} is not valid TOML: {err}") from err
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):  # allow [sections] for readability; keys stay flat
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_")] = value
    unknown = sorted(set(flat) - option_names())
    if unknown:
        raise UserError(f"--config {path}: unknown option {unknown[0]!r}")
    return flat


def resolve(flags: dict[str, Any], config_file: str | None) -> TrainOptions:
    """Defaults, then the TOML file, then the flags the user actually gave (non-None)."""
    values: dict[str, Any] = read_toml(config_file) if config_file else {}
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        options = TrainOptions(**values)
    except TypeError as err:
        raise UserError(f"bad option: {err}") from err
    return options.validate()
