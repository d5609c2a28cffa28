"""`TrainOptions`: every option of `ouro train`, typed, defaulted and validated in one place.

The CLI maps its flags onto these fields; a TOML `--config` file may set any of them
(flags given on the command line override it). The resolved options are recorded in
the run's manifest, and the subset that defines the run's contract goes into
`ouro-plan.json` (see plan.py), which `ouro resume` holds the run to.

Combinations an execution mode cannot run (speculation with a depth schedule, threshold
exits or async scheduling; CUDA graphs without CUDA) fail loudly instead of being ignored.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from ouro_cli.errors import UserError

BUNDLED = Path(__file__).resolve().parents[1] / "bundled" / "tiny"  # package data (ouro_cli/bundled)

@dataclass
class TrainOptions:
    # ---- what to train on --------------------------------------------------------
    model: str = str(BUNDLED / "model")
    data: str = str(BUNDLED / "train.jsonl")
    run_dir: str | None = None
    prompt_template: str = "chatml"
    reward_function: str = "ouro_cli.rl.rewards.boxed_answer"

    # ---- the GRPO update ---------------------------------------------------------
    updates: int = 80
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
    lr: float = 1e-4
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    clip_grad: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    aggregation: str = "token_mean"
    micro_batch_size: int | None = None  # a cap on samples per micro-batch; None: only the token budget
    max_tokens_per_micro_batch: int | None = None  # None: what fits in the memory left (rl/sizing.py)
    recompute: str = "auto"  # auto: on only when the memory budget needs it; on; off
    use_distributed_optimizer: bool = False
    offload_optimizer: bool = False  # main weights and Adam moments in host memory between optimizer steps

    # ---- engine ------------------------------------------------------------------
    engine: str = "ouro_cli.engine.factory:default_factory"
    device: str = "auto"
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9  # fraction of device (CPU: host) memory the run may fill
    max_num_seqs: int | None = None  # cap on sequences decoded together; None: what a call submits (<= 512)
    kv_blocks: int | None = None  # paged KV blocks at T planes; None: sized from the memory budget
    block_size: int = 16
    cuda_graphs: bool = False  # require CUDA-graph decode (the engine's default on CUDA anyway)
    async_scheduling: bool = False
    speculative_tokens: int = 0
    prefill_devices: list[int] = field(default_factory=list)
    decode_devices: list[int] = field(default_factory=list)

    # ---- saving, evaluation, export ---------------------------------------------
    save_interval: int = 20  # also always at the end; 0: only at the end
    keep_last: int | None = 2
    async_save: bool = False  # write checkpoints in the background while the next update runs
    eval_data: str | None = str(BUNDLED / "eval.jsonl")
    eval_prompts: int = 200
    eval_interval: int = 0  # 0: before the first and after the last update only
    eval_depths: list[int] = field(default_factory=lambda: [2, 3, 4])
    export_hf: str | None = None
    overwrite: bool = False
    state_digest: bool = False  # sha256 of model + optimizer state per update (verify-resume)
    save_on_interrupt: str = "auto"  # SIGINT/SIGTERM: save first? on, off, or auto (rl/stop.py)
    test_break_resume: bool = False  # test-only: reseed the sampler after a resume (must be caught)

    def validate(self) -> TrainOptions:
        if isinstance(self.recompute, bool):  # plans and TOML files written before "auto" existed
            self.recompute = "on" if self.recompute else "off"
        if self.recompute not in ("auto", "on", "off"):
            raise UserError(f"--recompute must be auto, on or off, got {self.recompute!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(f"--gpu-memory-utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_num_seqs", "kv_blocks", "max_tokens_per_micro_batch", "micro_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.cuda_graphs and self.device == "cpu":
            raise UserError("--cuda-graphs captures decode steps on a GPU; it cannot run with --device cpu")
        if self.group_size < 2:  # before the >= 1 rule, so that 0 and 1 get the same answer
            raise UserError(f"--group-size must be at least 2: GRPO normalises rewards within a group, "
                            f"got {self.group_size}")
        positive = ("updates", "prompts_per_update", "max_response_len", "block_size", "eval_prompts")
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
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
        if self.save_on_interrupt not in ("auto", "on", "off"):
            raise UserError(f"--save-on-interrupt must be auto, on or off, got {self.save_on_interrupt!r}")
        if self.keep_last is not None and self.keep_last < 1:
            raise UserError("--keep-last must be at least 1")
        self._validate_speculation()
        self._validate_disaggregation()
        self._validate_kernel_settings()
        return self

    def _validate_kernel_settings(self) -> None:
        """OURO_DECODE_ATTENTION / OURO_DECODE_GEMV / OURO_DECODE_ROPE / OURO_REPLAY_ATTENTION /
        OURO_COMPILE_LAYERS, before anything runs."""
        import torch

        from ouro_cli.kernels import check_settings

        cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        check_settings(torch.device("cuda" if cuda else "cpu"))

    def _validate_disaggregation(self) -> None:
        """`--prefill-devices/--decode-devices` run the PD engine (ouro_cli.engine.pd): both or
        neither, each index once per role (CUDA indices; on CPU each index is a worker process)."""
        if not (self.prefill_devices or self.decode_devices):
            return
        if not (self.prefill_devices and self.decode_devices):
            raise UserError("--prefill-devices and --decode-devices go together: give both")
        for flag, devices in (("--prefill-devices", self.prefill_devices), ("--decode-devices", self.decode_devices)):
            if len(set(devices)) != len(devices) or min(devices) < 0:
                raise UserError(f"{flag} must list distinct device indices >= 0, got {devices}")
        if self.engine != TrainOptions().engine:
            raise UserError("--prefill-devices/--decode-devices build the PD engine; drop --engine")
        if self.speculative_tokens or self.async_scheduling:
            raise UserError("--prefill-devices/--decode-devices do not run with --speculative-tokens or "
                            "--async-scheduling yet")

    def _validate_speculation(self) -> None:
        """Speculation verifies every draft at full depth T: it needs `--depths T` alone (the loop
        checks K = T once the model is known), no threshold exits, synchronous scheduling; held-out
        evaluations then run at K = T only (`--eval-depths` left at its default is set to it)."""
        if self.speculative_tokens < 0:
            raise UserError(f"--speculative-tokens must be >= 0, got {self.speculative_tokens}")
        if not self.speculative_tokens:
            return
        if self.async_scheduling:
            raise UserError("--speculative-tokens needs synchronous scheduling; drop --async-scheduling")
        if len(self.depths) != 1:
            raise UserError(f"--speculative-tokens needs --depths T alone (the full depth, e.g. --depths 4), "
                            f"got --depths {' '.join(map(str, self.depths))}")
        if self.exit_threshold != 1:
            raise UserError("--speculative-tokens needs --exit-threshold 1: drafts are verified at full depth")
        if self.eval_depths not in (TrainOptions().eval_depths, self.depths):
            raise UserError(f"--speculative-tokens evaluates at K = {self.depths[0]} only; drop --eval-depths or "
                            f"pass --eval-depths {self.depths[0]}")
        self.eval_depths = list(self.depths)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def option_names() -> set[str]:
    return {f.name for f in fields(TrainOptions)}


def read_toml(path: str | Path) -> dict[str, Any]:
    """Options from a TOML file: top-level keys named like the flags (dashes or underscores),
    each value of its option's type (`check_types`)."""
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
    check_types(flat, f"--config {path}")
    hints = get_type_hints(TrainOptions)
    return {k: float(v) if hints[k] is float else v for k, v in flat.items()}


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def check_types(values: dict[str, Any], where: str) -> None:
    """Every value must have its option's type (the field annotations): an int is a float, a
    bool is not an int, a list holds its element type; a mismatch names the key."""
    hints = get_type_hints(TrainOptions)
    for key, value in values.items():
        expected = hints[key]
        if not _has_type(value, expected):
            wanted = " or ".join(_describe(t) for t in get_args(expected) if t is not type(None)) \
                if get_origin(expected) in (Union, UnionType) else _describe(expected)
            raise UserError(f"{where}: {key} must be {wanted}, got {value!r} ({type(value).__name__})")


def _has_type(value: Any, expected: Any) -> bool:
    origin = get_origin(expected)
    if origin in (Union, UnionType):
        return any(_has_type(value, t) for t in get_args(expected))
    if origin is list:
        return isinstance(value, list) and all(_has_type(v, get_args(expected)[0]) for v in value)
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _describe(expected: Any) -> str:
    if get_origin(expected) is list:
        return f"a list of {_describe(get_args(expected)[0]).removeprefix('an ').removeprefix('a ')}s"
    return _TYPE_NAMES.get(expected, getattr(expected, "__name__", str(expected)))


def resolve(flags: dict[str, Any], config_file: str | None) -> TrainOptions:
    """Defaults, then the TOML file, then the flags the user actually gave (non-None)."""
    values: dict[str, Any] = read_toml(config_file) if config_file else {}
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        options = TrainOptions(**values)
    except TypeError as err:
        raise UserError(f"bad option: {err}") from err
    return options.validate()
