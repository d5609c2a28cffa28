"""The options of `ouro train` and `ouro eval`: one tree each, typed, defaulted and validated here.

`TrainOptions` nests the trainer's own config (`trainer.TrainerConfig`), the engine's
(`EngineOptions`), the sampling (`SamplingOptions`), the prompt/reward task
(`TaskOptions`) and the kernels and compilation (`settings.ExecutionSettings`);
`EvalOptions` shares the last three. Each default and help line is
written once, on its field; the CLI builds its flags from them (cli/options.py), a TOML
`--config` file may set any of them by flat name or under its section's heading
(ouro_cli/config.py), and flags given on the command line override the file. The
resolved options are recorded in the run's manifest, and the part that defines what the
run computes goes into `ouro-plan.json` (plan.py), which `ouro resume` holds the run to.

`validate` is the one place a tree is checked: each section's own rules (a section
checks itself when it is built), then the rules that span sections. Combinations an
execution mode cannot run fail loudly instead of being ignored: the pairs of options that
change what a run trains or samples are refused or tested by one table (rl/combinations.py:
speculation with threshold exits or async scheduling, PD with either or with several ranks),
and speculation needs one depth, CUDA graphs a GPU.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ouro_cli import config as tree
from ouro_cli import defaults
from ouro_cli.config import P_DATA, P_ENGINE, P_GRPO, P_OPT, P_RUN, option, section
from ouro_cli.defaults import AUTO, Auto, Choice, choose
from ouro_cli.errors import UserError
from ouro_cli.rl.data import Columns, check_mapping
from ouro_cli.settings import ExecutionSettings, from_environment
from ouro_cli.trainer.config import DEFAULT_SEED, TrainerConfig

BUNDLED = Path(__file__).resolve().parents[1] / "bundled" / "tiny"  # package data (ouro_cli/bundled)
DEFAULT_ENGINE = "ouro_cli.engine.factory:default_factory"  # engine/factory.py DEFAULT_FACTORY
DEFAULT_DEPTHS = (2, 3, 4)
AUTO_REWARD, BOXED_REWARD, MATH_REWARD = "auto", "ouro_cli.rl.rewards.boxed_answer", "ouro_cli.rl.rewards.math_answer"

# The options of `ouro train` that name files or directories: recorded absolute (`TrainOptions.absolute`).
PATH_OPTIONS = ("model", "data", "eval_data", "export_hf")


@dataclass
class TaskOptions:
    """How a prompt is rendered and a response graded."""

    prompt_template: str = option("chatml", help="chatml, raw, or tokenizer (the model's chat template).", panel=P_DATA)
    reward_function: str = option(
        AUTO_REWARD,
        help="Dotted path of f(response, label[, metadata]) -> float; auto: the DeepScaleR math grader "
        "(rewards.math_answer), or rewards.boxed_answer for the bundled integer task.",
        panel=P_DATA,
    )  # checked by template.py, rewards/
    reward_timeout: float | None = option(
        None,
        help="Seconds one reward call may take; a slower call stops the run, naming the function.",
        panel=P_DATA,
        shown="none",
    )

    def __post_init__(self) -> None:
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            raise UserError(f"--reward-timeout must be > 0 seconds, got {self.reward_timeout}")

    def resolve_reward(self, data: str) -> None:
        """`auto` becomes the grader it stands for (what the plan records), given the data
        (`auto_reward`)."""
        if self.reward_function == AUTO_REWARD:
            self.reward_function = auto_reward(data)


def auto_reward(data: str) -> str:
    """The grader `--reward-function auto` stands for on `data`: the bundled task's integer
    answers are graded by boxed_answer, any other data by the DeepScaleR grader, which needs a
    `</think>` in the response (rewards/math_grader.py)."""
    return BOXED_REWARD if Path(data).resolve().parent == BUNDLED.resolve() else MATH_REWARD


@dataclass
class SamplingOptions:
    """How a response is sampled, in rollouts and in evaluations."""

    temperature: float = option(1.0, help="Sampling temperature.", panel=P_GRPO)
    max_response_len: int | Auto = option(
        AUTO,
        help=f"Tokens per response; {defaults.help_for('max_response_len')}",
        panel=P_GRPO,
        aliases=("--rollout-max-response-len",),
    )
    exit_threshold: float = option(
        1.0, help="Native early exit at CDF >= threshold (1 = exactly K loops).", panel=P_GRPO
    )
    min_loops: int = option(1, help="Fewest loops a decoded token runs.", panel=P_GRPO)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise UserError("--temperature must be > 0 (GRPO samples; processed logprobs need T > 0)")
        length = None if self.max_response_len == AUTO else self.max_response_len
        tree.at_least(1, max_response_len=length, min_loops=self.min_loops)
        if not 0 < self.exit_threshold <= 1:
            raise UserError("--exit-threshold must lie in (0, 1]")


@dataclass
class ColumnOptions:
    """Where a data row holds its prompt, label and id (rl/data.py reads through this mapping)."""

    prompt_key: str = option(
        Columns.prompt, help="Field of a row holding the prompt; dots reach into nested fields.", panel=P_DATA
    )
    label_key: str = option(
        Columns.label, help="Field holding the label, e.g. answer or reward_model.ground_truth.", panel=P_DATA
    )
    id_key: str = option(Columns.id, help="Field holding the problem id (a row without one: its index).", panel=P_DATA)
    label_parser: str = option(
        Columns.label_parser,
        help="none, or gsm8k: the label is the number after '####' in GSM8K's answer text.",
        panel=P_DATA,
    )

    def __post_init__(self) -> None:
        check_mapping(
            {
                "--prompt-key": self.prompt_key,
                "--label-key": self.label_key,
                "--id-key": self.id_key,
                "--label-parser": self.label_parser,
            }
        )


@dataclass
class EvalColumnOptions:
    """The column mapping of `--eval-data`; each key not given is `--data`'s (rl/data.py columns_for)."""

    eval_prompt_key: str | None = option(None, help="--prompt-key of --eval-data.", panel=P_RUN, shown="--prompt-key's")
    eval_label_key: str | None = option(None, help="--label-key of --eval-data.", panel=P_RUN, shown="--label-key's")
    eval_id_key: str | None = option(None, help="--id-key of --eval-data.", panel=P_RUN, shown="--id-key's")
    eval_label_parser: str | None = option(
        None, help="--label-parser of --eval-data.", panel=P_RUN, shown="--label-parser's"
    )

    def __post_init__(self) -> None:
        check_mapping(
            {
                "--eval-prompt-key": self.eval_prompt_key,
                "--eval-label-key": self.eval_label_key,
                "--eval-id-key": self.eval_id_key,
                "--eval-label-parser": self.eval_label_parser,
            }
        )


@dataclass
class WandbOptions:
    """Where `--logger wandb` files a run (rl/loggers.py); its run id is kept in RUN/logs/wandb_id."""

    wandb_project: str | None = option(None, help="W&B project (--logger wandb).", panel=P_RUN, shown="ouro")
    wandb_entity: str | None = option(
        None, help="W&B entity: user or team (--logger wandb).", panel=P_RUN, shown="your W&B default"
    )
    wandb_name: str | None = option(
        None, help="W&B run name (--logger wandb).", panel=P_RUN, shown="the run directory's name"
    )
    wandb_tags: list[str] = option(
        factory=list,
        flag="--wandb-tag",
        aliases=("--wandb-tags",),
        help="W&B run tag (--logger wandb); repeat for several.",
        panel=P_RUN,
    )

    def given(self) -> list[str]:
        """The flags of the options that are set."""
        values = {"--wandb-project": self.wandb_project, "--wandb-entity": self.wandb_entity}
        values.update({"--wandb-name": self.wandb_name, "--wandb-tag": self.wandb_tags})
        return [flag for flag, value in values.items() if value]


@dataclass
class EngineOptions:
    """The rollout engine a run builds (engine/factory.py, or the PD engine of engine/pd/)."""

    factory: str = option(
        DEFAULT_ENGINE,
        name="engine",
        help="Dotted path of an engine factory.",
        panel=P_ENGINE,
        shown="the built-in engine",
    )  # its dotted path does not fit an 80-column help
    max_num_seqs: int | None = option(
        None,
        help="Cap on sequences decoded together.",
        panel=P_ENGINE,
        shown="as many as a rollout submits, up to 512; the KV cache limits what runs at once",
    )
    kv_blocks: int | None = option(
        None, help="Paged KV blocks of T planes per layer.", panel=P_ENGINE, shown="sized from --gpu-memory-utilization"
    )
    block_size: int = option(16, help="Tokens per KV block.", panel=P_ENGINE)
    cuda_graphs: bool = option(
        False,
        help="Make CUDA-graph decoding a requirement: a run that cannot capture them fails. A GPU run "
        "decodes with CUDA graphs either way; off only does not insist.",
        panel=P_ENGINE,
    )
    async_scheduling: bool = option(
        False, help="Queue each decode loop before reading the last exit signal (forces delayed exits).", panel=P_ENGINE
    )
    share_prompts: bool = option(
        True,
        help="Hold a group's prompt K/V once for all its samples and read it once per decode step; "
        "--no-share-prompts gives each sample its own copy (more memory, slower; the same tokens).",
        panel=P_ENGINE,
    )
    speculative_tokens: int = option(
        0, help="Self-speculation: draft N tokens at 2 loops, verify at T (needs --depths T alone).", panel=P_ENGINE
    )
    prefill_devices: list[int] = option(
        factory=list, help="Prefill worker devices (PD disaggregation; CPU: worker processes).", panel=P_ENGINE
    )
    decode_devices: list[int] = option(factory=list, help="Decode worker devices (PD disaggregation).", panel=P_ENGINE)
    kv_transport: Literal["auto", "nixl", "shm"] = option(
        "auto",
        help="How PD workers move KV: auto (NIXL when installed, else shared memory), nixl or shm.",
        panel=P_ENGINE,
        env="OURO_PD_TRANSPORT",
    )
    pd_worker_threads: int = option(
        1, help="Torch threads of each PD worker process (CPU workers).", panel=P_ENGINE, env="OURO_PD_THREADS"
    )

    def __post_init__(self) -> None:
        tree.at_least(
            1,
            max_num_seqs=self.max_num_seqs,
            kv_blocks=self.kv_blocks,
            block_size=self.block_size,
            pd_worker_threads=self.pd_worker_threads,
        )
        if self.speculative_tokens < 0:
            raise UserError(f"--speculative-tokens must be >= 0, got {self.speculative_tokens}")
        if self.kv_transport not in ("auto", "nixl", "shm"):
            raise UserError(f"--kv-transport must be auto, nixl or shm, got {self.kv_transport!r}")
        if self.disaggregated:
            self._check_disaggregation()

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_devices or self.decode_devices)

    @property
    def built_in_local(self) -> bool:
        """The run's engine is the built-in local one (not the PD engine, not an --engine factory)."""
        return not self.disaggregated and self.factory == DEFAULT_ENGINE

    @property
    def releases_memory(self) -> bool:
        """The built-in local engine hands its KV cache back for the train step (rl/sizing.py)."""
        return self.built_in_local

    @property
    def shares_prompts(self) -> bool:
        """The built-in local engine holds a group's full prompt KV blocks once (engine/scheduler.py)
        unless --no-share-prompts; the PD engine and other factories keep a copy per sample."""
        return self.built_in_local and self.share_prompts

    def _check_disaggregation(self) -> None:
        """`--prefill-devices/--decode-devices` run the PD engine (ouro_cli.engine.pd): both or
        neither, each index once per role (CUDA indices; on CPU each index is a worker process)."""
        if not (self.prefill_devices and self.decode_devices):
            raise UserError("--prefill-devices and --decode-devices go together: give both")
        for flag, devices in (("--prefill-devices", self.prefill_devices), ("--decode-devices", self.decode_devices)):
            if len(set(devices)) != len(devices) or min(devices) < 0:
                raise UserError(f"{flag} must list distinct device indices >= 0, got {devices}")
        if self.factory != DEFAULT_ENGINE:
            raise UserError("--prefill-devices/--decode-devices build the PD engine; drop --engine")


@dataclass
class TrainOptions:
    """Every option of `ouro train` (and what `ouro resume` reads back from the plan)."""

    # ---- what to train on --------------------------------------------------------
    model: str = option(
        str(BUNDLED / "model"),
        help="HF directory or Megatron checkpoint to start from.",
        panel=P_DATA,
        shown="bundled tiny model",
    )
    data: str = option(
        str(BUNDLED / "train.jsonl"),
        help="Training data: JSONL, Parquet, or a datasets save_to_disk directory.",
        panel=P_DATA,
        shown="bundled",
    )
    columns: ColumnOptions = section(ColumnOptions)
    task: TaskOptions = section(TaskOptions)

    # ---- the GRPO update ---------------------------------------------------------
    depths: list[int] = option(
        factory=lambda: list(DEFAULT_DEPTHS), help="Decode budget K per update, cycled: --depths 2 3 4.", panel=P_GRPO
    )
    updates: int = option(80, help="Number of GRPO updates.", panel=P_GRPO)
    # resolved to --updates when a run starts, and recorded: a resume to more updates (or a run
    # stopped early and resumed, as verify-resume does) keeps the schedule it started with
    lr_decay_updates: int | None = option(
        None,
        help="--lr-schedule cosine: the updates over which the LR decays to --min-lr; later updates keep --min-lr.",
        panel=P_OPT,
        shown="--updates of the run's start",
    )
    prompts_per_update: int = option(16, help="Prompts per update (global).", panel=P_GRPO)
    group_size: int = option(8, help="Samples per prompt.", panel=P_GRPO)
    sampling: SamplingOptions = section(SamplingOptions)
    # what an update trains on, and how (docs/grpo.md)
    advantage: Literal["grpo", "dr-grpo", "rloo"] = option(
        "grpo",
        help="grpo: (r - group mean) / group std; dr-grpo: r - group mean, with a constant-length loss; rloo: "
        "r - mean of the group's other rewards.",
        panel=P_GRPO,
    )
    mini_batches: int = option(
        1, help="Optimizer steps per update: its groups split, in order, into N mini-batches.", panel=P_GRPO
    )
    epochs: int = option(1, help="Passes over the update's mini-batches.", panel=P_GRPO)
    filter_groups: bool = option(
        False,
        help="Drop groups whose rewards are all equal and draw more prompts to refill "
        "the update (DAPO dynamic sampling).",
        panel=P_GRPO,
    )
    max_refill: int | None = option(
        None,
        help="Prompts --filter-groups may draw beyond --prompts-per-update.",
        panel=P_GRPO,
        shown="4 x --prompts-per-update",
    )
    overlong: Literal["none", "mask", "soft"] = option(
        "none",
        help="Truncated responses: trained as any other (none), left out of the loss (mask), or penalised "
        "over --overlong-buffer (soft).",
        panel=P_GRPO,
    )
    overlong_buffer: int | None = option(
        None,
        help="soft: the last N tokens of --max-response-len, over which the length penalty falls from 0 to -1.",
        panel=P_GRPO,
        shown="a quarter of --max-response-len",
    )
    seq_length: int | None = option(None, help="Prompt + response token limit.", panel=P_GRPO, shown="the model's")
    max_position_embeddings: int | None = option(
        None, help="Must equal the model's value when given.", panel=P_GRPO, shown="the model's"
    )

    # ---- the engine --------------------------------------------------------------
    engine: EngineOptions = section(EngineOptions)
    gpu_memory_utilization: float = option(
        0.9, help="Fraction of device memory the run may fill, trainer included; host memory on CPU.", panel=P_ENGINE
    )

    # ---- saving, evaluation, export ---------------------------------------------
    run_dir: str | None = option(None, help="Run directory.", panel=P_RUN, shown="runs/ouro-<timestamp>")
    save_interval: int = option(
        20, help="Checkpoint every N updates (0: only at the end), and always at the end.", panel=P_RUN
    )
    eval_data: str | None = option(
        str(BUNDLED / "eval.jsonl"),
        help="Held-out data: JSONL, Parquet, or a datasets save_to_disk directory ('' for none).",
        panel=P_RUN,
        shown="bundled",
    )
    eval_columns: EvalColumnOptions = section(EvalColumnOptions)
    eval_prompts: int | Auto = option(
        AUTO, help=f"Held-out prompts per evaluation; {defaults.help_for('eval_prompts')}", panel=P_RUN
    )
    eval_interval: int = option(0, help="Evaluate every N updates (always at start and end).", panel=P_RUN)
    eval_depths: list[int] = option(factory=lambda: list(DEFAULT_DEPTHS), help="K values evaluated.", panel=P_RUN)
    eval_samples: int = option(1, help="Samples per held-out prompt and K (avg@N and pass@k).", panel=P_RUN)
    export_hf: str | None = option(None, help="Export the final model as an HF directory here.", panel=P_RUN)
    plot: bool = option(
        False, help="Draw RUN/metrics.png at the end of the run (`ouro plot RUN` draws it at any time).", panel=P_RUN
    )
    overwrite: bool = option(False, help="Start over in a non-empty run directory.", panel=P_RUN)
    loggers: list[str] = option(
        factory=list,
        name="loggers",
        flag="--logger",
        help="Also log to tensorboard "
        "(RUN/logs/tensorboard) or wandb (the wandb extra; WANDB_MODE=offline works); "
        "repeat for both.",
        panel=P_RUN,
    )
    wandb: WandbOptions = section(WandbOptions)
    state_digest: bool = option(False, help="Record a sha256 of model + optimizer state per update.", panel=P_RUN)
    save_on_interrupt: str = option(
        "auto",
        help="On SIGINT/SIGTERM, save before stopping: on, off, or auto (when a checkpoint is due within 3 updates).",
        panel=P_RUN,
    )

    # ---- the trainer: its seed and devices, optimizer, loss, micro-batching, checkpoints ----
    trainer: TrainerConfig = section(TrainerConfig)

    # ---- kernels and compilation, for the trainer and the engine alike ----------
    execution: ExecutionSettings = section(ExecutionSettings)

    # not an option: the path options as the user gave them, where `absolute` changed them (kept in
    # the plan, so that a resume can show the original of a file that went missing)
    given_paths: dict[str, str] = field(default_factory=dict)
    # not an option: what each option left at `auto` resolved to, for the command to say
    chosen: list[Choice] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.resolve_auto()

    def absolute(self) -> TrainOptions:
        """These options with each relative path option (PATH_OPTIONS) made absolute against the
        working directory, the originals kept in `given_paths`: a run records its files absolute,
        so that a resume from another directory reads the same files."""
        changed = {
            name: os.path.abspath(value)
            for name in PATH_OPTIONS
            if (value := getattr(self, name)) and not os.path.isabs(value)
        }
        given = {**self.given_paths, **{name: getattr(self, name) for name in changed}}
        return dataclasses.replace(self, **changed, given_paths=given)

    def shown_path(self, name: str) -> str:
        """A path option as recorded, and as first given when that differs."""
        value, given = getattr(self, name), self.given_paths.get(name)
        return f"{value} (given as {given})" if given and given != value else str(value)

    def resolve_auto(self) -> None:
        """Each option left at `auto` becomes its value for this model (ouro_cli/defaults.py),
        noted in `chosen`: options are built resolved, so what they record is a value."""
        recipe = defaults.recipe_for(self.model)
        t, s = self.trainer, self.sampling
        t.lr = choose("--lr", t.lr, "lr", recipe, self.chosen)
        s.max_response_len = choose("--max-response-len", s.max_response_len, "max_response_len", recipe, self.chosen)
        self.eval_prompts = choose("--eval-prompts", self.eval_prompts, "eval_prompts", recipe, self.chosen)

    def validate(self) -> TrainOptions:
        """The rules of the job as a whole (each section checked itself when it was built)."""
        self.task.resolve_reward(self.data)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(f"--gpu-memory-utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.engine.cuda_graphs and self.trainer.device == "cpu":
            raise UserError("--cuda-graphs captures decode steps on a GPU; it cannot run with --device cpu")
        if self.group_size < 2:  # before the >= 1 rule, so that 0 and 1 get the same answer
            raise UserError(
                f"--group-size must be at least 2: GRPO normalises rewards within a group, got {self.group_size}"
            )
        tree.at_least(
            1,
            updates=self.updates,
            prompts_per_update=self.prompts_per_update,
            eval_prompts=self.eval_prompts,
            eval_samples=self.eval_samples,
            lr_decay_updates=self.lr_decay_updates,
        )
        self._validate_update()
        if self.save_interval < 0 or self.eval_interval < 0:
            raise UserError("--save-interval and --eval-interval must be >= 0")
        if self.save_on_interrupt not in ("auto", "on", "off"):
            raise UserError(f"--save-on-interrupt must be auto, on or off, got {self.save_on_interrupt!r}")
        from .loggers import check_loggers

        check_loggers(self.loggers)
        if "wandb" not in self.loggers and (given := self.wandb.given()):
            one = len(given) == 1
            raise UserError(
                f"{', '.join(given)} {'is' if one else 'are'} for --logger wandb; pass --logger wandb too, "
                f"or drop {'it' if one else 'them'}"
            )
        from ouro_cli.mcore.process import launched_ranks

        from .combinations import check

        check(self, launched_ranks())
        self._validate_speculation()
        self.trainer.validate()
        self.execution.check(self.trainer.resolved_device)
        self.execution.check_model_dtype(self.trainer.resolved_dtype == "bf16")
        return self

    def _validate_update(self) -> None:
        """The update's shape: mini-batches of whole groups, refill budget, overlong handling."""
        for flag, value, allowed in (
            ("--advantage", self.advantage, ("grpo", "dr-grpo", "rloo")),
            ("--overlong", self.overlong, ("none", "mask", "soft")),
        ):
            if value not in allowed:
                raise UserError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
        tree.at_least(1, mini_batches=self.mini_batches, epochs=self.epochs, overlong_buffer=self.overlong_buffer)
        tree.at_least(0, max_refill=self.max_refill)
        if self.mini_batches > self.prompts_per_update:
            raise UserError(
                f"--mini-batches {self.mini_batches} is more than the {self.prompts_per_update} prompts "
                "of an update: a mini-batch holds whole groups; use at most --prompts-per-update"
            )
        if self.max_refill is not None and not self.filter_groups:
            raise UserError("--max-refill is the budget of --filter-groups; pass --filter-groups too, or drop it")
        if self.overlong_buffer is not None:
            if self.overlong != "soft":
                raise UserError("--overlong-buffer is the penalty buffer of --overlong soft; pass it too, or drop it")
            if self.overlong_buffer > self.sampling.max_response_len:
                raise UserError(
                    f"--overlong-buffer {self.overlong_buffer} is more than --max-response-len "
                    f"{self.sampling.max_response_len}"
                )

    @property
    def refill_budget(self) -> int:
        """Prompts --filter-groups may draw beyond the update's first --prompts-per-update."""
        if not self.filter_groups:
            return 0
        return 4 * self.prompts_per_update if self.max_refill is None else self.max_refill

    @property
    def length_buffer(self) -> int:
        """--overlong soft's buffer in tokens (at least 1)."""
        if self.overlong_buffer is not None:
            return self.overlong_buffer
        return max(1, self.sampling.max_response_len // 4)

    @property
    def optimizer_steps_per_update(self) -> int:
        return self.mini_batches * self.epochs

    def _validate_speculation(self) -> None:
        """Speculation verifies every draft at full depth T: it needs `--depths T` alone (the loop
        checks K = T once the model is known; threshold exits and async scheduling are refused
        with it, rl/combinations.py); held-out evaluations then run at K = T only (`--eval-depths`
        left at its default is set to it)."""
        if not self.engine.speculative_tokens:
            return
        if len(self.depths) != 1:
            raise UserError(
                f"--speculative-tokens needs --depths T alone (the full depth, e.g. --depths 4), "
                f"got --depths {' '.join(map(str, self.depths))}"
            )
        if self.eval_depths not in (list(DEFAULT_DEPTHS), self.depths):
            raise UserError(
                f"--speculative-tokens evaluates at K = {self.depths[0]} only; drop --eval-depths or "
                f"pass --eval-depths {self.depths[0]}"
            )
        self.eval_depths = list(self.depths)

    @property
    def seed(self) -> int:
        """The run seed (the trainer's): data order, sampling, initialisation."""
        return self.trainer.seed

    def to_dict(self) -> dict[str, Any]:
        """The options by flat name: what the manifest and the plan record."""
        return tree.flat(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainOptions:
        """Options recorded by `to_dict`, not yet validated."""
        return tree.build(cls, values, where="ouro-plan.json", check=False)


@dataclass
class EvalOptions:
    """Every option of `ouro eval`."""

    model: str = option(help="HF directory, Megatron checkpoint or run directory.", argument=True)
    data: str = option(help="Held-out data: JSONL, Parquet or a datasets save_to_disk directory.")
    columns: ColumnOptions = section(ColumnOptions)
    depths: list[int] = option(
        factory=lambda: list(DEFAULT_DEPTHS), help="Decode budgets K to evaluate: --depths 2 3 4."
    )
    prompts: int | Auto = option(AUTO, help=f"Evaluate the first N prompts; {defaults.help_for('prompts')}")
    samples: int = option(1, help="Samples per prompt and K: avg@N, and pass@k for k = 1, 2, 4, ... <= N.")
    task: TaskOptions = section(TaskOptions)
    sampling: SamplingOptions = section(SamplingOptions)
    seed: int = option(DEFAULT_SEED, help="Sampling seed.")
    device: str = option("auto", help="auto, cpu or cuda.")
    max_num_seqs: int = option(
        64, help="Sequences decoded together (the KV cache holds that many of up to 2,048 tokens)."
    )
    execution: ExecutionSettings = section(ExecutionSettings)
    out: str | None = option(None, help="Output directory (outside every input).", shown="evals/ouro-eval-<timestamp>")
    overwrite: bool = option(False, help="Replace a non-empty output directory (never an input).")
    # not an option: what each option left at `auto` resolved to (TrainOptions.chosen)
    chosen: list[Choice] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        """`auto` options resolved for the model (TrainOptions.resolve_auto)."""
        recipe, s = defaults.recipe_for(self.model), self.sampling
        self.prompts = choose("--prompts", self.prompts, "prompts", recipe, self.chosen)
        s.max_response_len = choose("--max-response-len", s.max_response_len, "max_response_len", recipe, self.chosen)

    def validate(self) -> EvalOptions:
        self.task.resolve_reward(self.data)
        tree.at_least(1, prompts=self.prompts, samples=self.samples, max_num_seqs=self.max_num_seqs)
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        self.execution.check(self.resolved_device)
        return self

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def to_dict(self) -> dict[str, Any]:
        return tree.flat(self)


def read_toml(path: str | Path) -> dict[str, Any]:
    """`ouro train` options from a TOML file (ouro_cli/config.py `read_toml`)."""
    return tree.read_toml(path, TrainOptions)


def resolve(flags: dict[str, Any], config_file: str | None) -> TrainOptions:
    """Defaults, then the OURO_* variables of the options that have one (settings.py), then the
    TOML file, then the flags the user actually gave (non-None)."""
    values = from_environment(TrainOptions)
    values.update(read_toml(config_file) if config_file else {})
    values.update({k: v for k, v in flags.items() if v is not None})
    # the file's types are checked, the flags' typed
    return tree.build(TrainOptions, values, check=False).validate().absolute()
