"""`TrainerConfig`: every option of the Megatron-core GRPO trainer, typed, defaulted and
validated in one place. `ouro train` nests it in its options (rl/options.py), so its
flags, TOML keys and recorded options are these fields (ouro_cli/config.py); the fields
declared with `option` are the ones a run may set, the others belong to the Python API.

Defaults follow docs/architecture.md §3: clipped policy gradient with ε_low 0.2 / ε_high 0.28,
token-mean aggregation, the exit loop's log-probability (docs/grpo.md), Adam, gradient
clipping at 1.0, a constant LR. The LR defaults to `auto`, which the job resolves from the
model (ouro_cli/defaults.py) before it builds the trainer; a trainer given `auto` by itself
uses the bundled tiny model's 1e-4 (`learning_rate`). The parameter dtype defaults to bf16
on CUDA (fp32 main weights in the optimizer) and fp32 on CPU, where bf16 buys nothing and
exactness tests need fp32.
Importing this module does not import torch (`ouro --help` builds its flags from it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ouro_cli import defaults
from ouro_cli.config import P_ENGINE, P_GRPO, P_OPT, P_RUN, option
from ouro_cli.defaults import AUTO, Auto
from ouro_cli.errors import UserError

DTYPES = ("fp32", "bf16")
# |log ratio| is clamped to this (trainer/loss.py): exp(20) ≈ 4.9e8 is finite in fp32 and bf16, and no
# ratio a clipped objective can use comes near it, so inside the bound the loss is the plain one
LOG_RATIO_BOUND = 20.0
AGGREGATIONS = ("auto", "token_mean", "sequence_mean", "constant_length")
LOOP_WEIGHTINGS = ("exit", "uniform", "progressive", "exit-pdf")
DEFAULT_SEED = 1234


@dataclass
class TrainerConfig:
    # ---- where and how it runs --------------------------------------------------
    device: Literal["auto", "cpu", "cuda"] = option("auto", help="auto, cpu or cuda.", panel=P_ENGINE)
    params_dtype: Literal["auto", "fp32", "bf16"] = option(
        "auto", name="dtype", help="auto (bf16 on CUDA, fp32 on CPU), fp32 or bf16.", panel=P_ENGINE
    )
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    seed: int = option(DEFAULT_SEED, help="Run seed: data order, sampling, init.", panel=P_GRPO)
    deterministic: bool = True  # CUDA: deterministic kernels in forward/backward (determinism.py)

    # ---- optimizer and schedule ---------------------------------------------------
    lr: float | Auto = option(AUTO, help=f"Learning rate; {defaults.help_for('lr')}", panel=P_OPT)
    lr_schedule: Literal["constant", "cosine"] = option("constant", help="constant or cosine.", panel=P_OPT)
    warmup_steps: int = option(
        0,
        help="LR warmup, counted in updates (each is --mini-batches x --epochs optimizer steps).",
        panel=P_OPT,
    )
    min_lr: float = option(0.0, help="Cosine: the LR it decays to.", panel=P_OPT)
    decay_steps: int | None = None  # cosine: steps from the start to min_lr (incl. warmup); the job: its updates
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = option(1.0, help="Gradient-norm clip (0 = off).", panel=P_OPT)
    use_distributed_optimizer: bool = option(
        False,
        help="Shard optimizer state over data-parallel ranks.",
        panel=P_OPT,
        flag="--dist-optimizer",
        aliases=("--use-distributed-optimizer",),
    )
    overlap_grad_reduce: bool = False
    # "auto": on when the run's memory plan gains KV cache by it (rl/sizing.py decides before the
    # trainer is built); a trainer given "auto" by itself keeps its state on the device.
    offload_optimizer: str = option(
        "auto",
        help="Where the fp32 main weights and Adam moments wait between optimizer steps: on (host memory, "
        "freeing 12 bytes per parameter on the device for two host copies per step), off (the device), or auto "
        "(on a GPU: the host only during the rollouts whose KV cache would not fit beside them).",
        panel=P_OPT,
    )

    # ---- GRPO loss ----------------------------------------------------------------
    eps_low: float = option(0.2, help="Ratio clip below 1.", panel=P_OPT)
    eps_high: float = option(0.28, help="Ratio clip above 1.", panel=P_OPT)
    # Off by default: the objective stays plain PPO/GRPO, and a run planned before the option
    # existed (read as having the default, rl/plan.py upgrade) keeps the loss it ran with.
    clip_ratio_c: float | None = option(
        None,
        help="Dual clip for negative advantages: a token's loss is at most -c x A, so a ratio above c "
        "takes no gradient (3 is common; > 1).",
        panel=P_OPT,
        shown="off",
    )
    log_ratio_bound: float = option(
        LOG_RATIO_BOUND,
        help="The log-ratio is clamped to +-B before exponentiating (a finite loss for any ratio).",
        panel=P_OPT,
    )
    aggregation: Literal["auto", "token_mean", "sequence_mean", "constant_length"] = option(
        "auto",
        help="How token terms are averaged: token_mean, sequence_mean, constant_length (sum over the "
        "batch / (samples x --max-response-len)), or auto: constant_length under --advantage dr-grpo, else "
        "token_mean.",
        panel=P_OPT,
    )
    aggregation_length: int | None = None  # constant_length's length; the job: its --max-response-len
    loop_weighting: Literal["exit", "uniform", "progressive", "exit-pdf"] = option(
        "exit",
        help="Whose log-probability the policy gradient follows: the exit loop's (exit), or a weighted sum "
        "over the executed loops: uniform, progressive (weight t^alpha), exit-pdf (the frozen exit gate's "
        "distribution).",
        panel=P_OPT,
    )
    loop_weight_alpha: float = option(
        1.0, help="progressive: the exponent alpha of loop t's weight t^alpha.", panel=P_OPT
    )

    # ---- rollout-trainer mismatch correction (is_correction.py; docs/exact.md §5) ---
    is_correction: Literal["none", "tis", "mis", "geo-mask"] = option(
        "none",
        help="Engine-trainer mismatch correction: none, tis (weigh by the ratio, at most HIGH), mis (mask "
        "tokens), geo-mask (mask sequences); docs/exact.md.",
        panel=P_OPT,
    )
    is_bounds: list[float] = option(
        factory=lambda: [0.5, 2.0], help="LOW HIGH: the ratio band of --is-correction.", panel=P_OPT, metavar="<lo hi>"
    )

    # ---- micro-batching -----------------------------------------------------------
    max_tokens_per_micro_batch: int | None = option(
        None,
        help="Tokens per training micro-batch, padding included.",
        panel=P_OPT,
        shown="what fits in the memory left",
    )  # the job sizes it (rl/sizing.py); the trainer alone: no limit
    micro_batch_size: int | None = option(
        None, help="At most this many samples per micro-batch.", panel=P_OPT, shown="no limit beside the token budget"
    )
    # the job's memory plan (rl/sizing.py token_cost_shares): count the micro-batch budget in full-depth
    # positions, {"loop": share per loop run, "idle": share of that per loop sat out while it
    # gathers} (batching.TokenCost); None: every position counts as one
    micro_batch_token_cost: dict[str, float] | None = None
    # the job's plan: replay a fixed-budget sample as a body (prompt at its deepest response
    # loop) and a prompt head scoring token 0 (batching.split_prompts); the same loss
    prompt_heads: bool = False
    prompt_head_overhead: float = 0.05  # split only where the repeated prompt loops cost at most this share
    # ... and the samples left whole and the heads before the bodies (split_prompts `deep_first`)
    deep_parts_first: bool = True
    pack: bool = True  # several samples per row (document masking) instead of one padded row each
    pack_length: int | None = None  # max tokens per packed row; None: the longest local sample
    # "auto": on when the run's memory plan needs it (rl/sizing.py decides before the trainer is
    # built); a trainer given "auto" by itself does not recompute. True/False read as on/off.
    recompute: str = option(
        "auto",
        help="Activation recompute per layer call: auto (on only when the memory budget needs it), on or off.",
        panel=P_OPT,
    )

    # ---- checkpoints --------------------------------------------------------------
    keep_last: int | None = option(2, help="Checkpoint iterations to keep (none: all).", panel=P_RUN)
    async_save: bool = option(
        False,
        help="Write checkpoints in the background while the next update runs; the next save and the end of "
        "the run wait for it.",
        panel=P_RUN,
        flag="--async-save/--sync-save",
    )

    extra: dict[str, Any] = field(default_factory=dict)  # recorded, not interpreted

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> TrainerConfig:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise UserError(message)

        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
            value = getattr(self, name)
            need(
                value == 1,
                f"{name}={value} is not supported yet: the trainer is data parallel only "
                "(TP = PP = CP = 1); scale out with more data-parallel ranks",
            )
        need(self.device in ("auto", "cpu", "cuda"), f"--device must be auto, cpu or cuda, got {self.device!r}")
        need(self.params_dtype in ("auto", *DTYPES), f"--dtype must be auto, fp32 or bf16, got {self.params_dtype!r}")
        if self.device == "cuda":  # "auto" picks CUDA only where it is there
            import torch

            need(torch.cuda.is_available(), "device=cuda but no CUDA device is visible")
        if isinstance(self.recompute, bool):  # the Python API
            self.recompute = "on" if self.recompute else "off"
        need(self.recompute in ("auto", "on", "off"), f"--recompute must be auto, on or off, got {self.recompute!r}")
        if isinstance(self.offload_optimizer, bool):  # the Python API
            self.offload_optimizer = "on" if self.offload_optimizer else "off"
        need(
            self.offload_optimizer in ("auto", "on", "off"),
            f"--offload-optimizer must be auto, on or off, got {self.offload_optimizer!r}",
        )
        need(self.eps_low >= 0 and self.eps_high >= 0, "--eps-low and --eps-high must be >= 0")
        need(self.eps_low < 1, "--eps-low must be < 1 (the ratio is clipped at 1 - eps_low)")
        need(
            self.clip_ratio_c is None or self.clip_ratio_c > 1,
            f"--clip-ratio-c must be > 1 (it caps the loss of ratios above it), got {self.clip_ratio_c}",
        )
        need(
            math.isfinite(self.log_ratio_bound) and self.log_ratio_bound > 0,
            f"--log-ratio-bound must be a finite number > 0, got {self.log_ratio_bound}",
        )
        need(
            self.aggregation in AGGREGATIONS,
            f"--aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}",
        )
        need(self.aggregation_length is None or self.aggregation_length >= 1, "aggregation_length must be >= 1")
        need(
            self.loop_weighting in LOOP_WEIGHTINGS,
            f"--loop-weighting must be one of {', '.join(LOOP_WEIGHTINGS)}, got {self.loop_weighting!r}",
        )
        need(math.isfinite(self.loop_weight_alpha), "--loop-weight-alpha must be a finite number")
        need(
            self.is_correction in ("none", "tis", "mis", "geo-mask"),
            f"--is-correction must be none, tis, mis or geo-mask, got {self.is_correction!r}",
        )
        need(
            len(self.is_bounds) == 2 and 0 <= self.is_bounds[0] <= 1 <= self.is_bounds[1],
            f"--is-bounds takes LOW HIGH with 0 <= LOW <= 1 <= HIGH, got {' '.join(map(str, self.is_bounds))}",
        )
        need(
            self.micro_batch_size is None or self.micro_batch_size >= 1,
            f"--micro-batch-size must be at least 1, got {self.micro_batch_size}",
        )
        need(
            self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 2,
            f"--max-tokens-per-micro-batch must be at least 2, got {self.max_tokens_per_micro_batch}",
        )
        cost = self.micro_batch_token_cost
        need(
            cost is None or (0 < cost.get("loop", 0) <= 1 and 0 <= cost.get("idle", 0) <= 1),
            f"micro_batch_token_cost needs 0 < loop <= 1 and 0 <= idle <= 1, got {cost}",
        )
        need(self.pack_length is None or self.pack_length >= 2, "pack_length must be >= 2 tokens")
        need(self.lr == AUTO or self.lr > 0, f"--lr must be > 0 or auto, got {self.lr!r}")
        need(0 <= self.min_lr <= self.learning_rate, "--min-lr must lie in [0, lr]")
        need(
            self.lr_schedule in ("constant", "cosine"),
            f"--lr-schedule must be constant or cosine, got {self.lr_schedule!r}",
        )
        need(self.warmup_steps >= 0, "--warmup-steps must be >= 0")
        # cosine needs decay_steps when the scheduler is built (optimizer.py); the job sets it
        need(self.decay_steps is None or self.decay_steps > self.warmup_steps, "decay_steps must exceed warmup_steps")
        need(self.weight_decay >= 0, "weight_decay must be >= 0")
        need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "adam betas must lie in [0, 1)")
        need(self.clip_grad >= 0, "--clip-grad must be >= 0 (0 disables clipping)")
        need(self.keep_last is None or self.keep_last >= 1, "--keep-last must be at least 1")
        return self

    @property
    def learning_rate(self) -> float:
        """The LR as a number: `auto` is the bundled tiny model's here (the job resolves it first)."""
        return defaults.TINY.lr if self.lr == AUTO else self.lr

    @property
    def resolved_aggregation(self) -> str:
        """The aggregation the loss uses: "auto" is token_mean here (the job resolves it first)."""
        return "token_mean" if self.aggregation == "auto" else self.aggregation

    @property
    def recomputes(self) -> bool:
        return self.recompute == "on"

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer == "on"

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def resolved_dtype(self) -> str:
        """The parameters' dtype, "bf16" or "fp32" (`auto`: bf16 on CUDA, fp32 elsewhere)."""
        if self.params_dtype == "auto":
            return "bf16" if self.resolved_device == "cuda" else "fp32"
        return self.params_dtype

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.resolved_dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
