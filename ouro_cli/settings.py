"""`ExecutionSettings`: which kernels and which compilation a run computes with.

The same function can be computed several ways on a GPU: the decode step's attention in
a Triton kernel or in torch, its projections through a Triton small-batch matmul or
cuBLAS, the elementwise layer math compiled or eager, the replay's attention in SDPA's
reduction order or the decode kernel's. Each choice changes the bits a GPU run computes
(on CPU, where runs stay eager and exact, most of them change nothing). `exact`
(`--exact`, docs/exact.md) chooses them all at once: batch-invariant kernels everywhere
(model/exact.py), eager, so that the engine's logprobs are the trainer's bit for bit.
`kv_cache_dtype` (`--kv-cache-dtype fp8`) changes the function itself: every layer call rounds
its K/V to fp8 (model/kv_quant.py), the engine's and the trainer's alike, and the engine's
cache stores them so. Since they change what a run computes, they are typed settings, not
switches read where they act:

- **Options.** They are options of `ouro train` and `ouro eval` like any other (the
  [execution] section of the option tree, ouro_cli/config.py: flags `--compile`,
  `--compile-layers`, `--decode-attention`, `--decode-gemv`, `--replay-attention`,
  `--exact`, `--kv-cache-dtype`, TOML keys), checked here with one-line errors and resolved
  once per command.
- **The environment as a fallback.** An option that declares a variable (`OURO_COMPILE`,
  ...; also the engine's `OURO_PD_TRANSPORT` and `OURO_PD_THREADS`, rl/options.py
  `EngineOptions`) takes its value from it when neither a flag nor the TOML file gives
  one (`from_environment`). A resumed run's plan takes the TOML file's place: a variable that is set is
  checked against it, like a flag.
- **Passed explicitly.** The model carries its settings (`OuroForCausalLM.execution`,
  read by model/pointwise.py and model/attention.py); the trainer and the engine are
  given them (`Trainer(..., execution=)`, `LLM(..., execution=)`) and set them on the
  models they run; the engine's runner picks its kernels from them; PD workers receive
  them with their weights.
- **Recorded.** The manifest records the options; the run's contract (rl/plan.py)
  records what they resolve to on the run's device (`effective`), so that `ouro resume`
  refuses a change of what a run computes, naming the setting, and accepts one that
  changes nothing there (`--decode-gemv cublas` on a CPU run).

Every variable, these included, is declared and read in ouro_cli/env.py; the ones that are
not options (`OURO_DEBUG`, the test-only `OURO_TEST_*`, Triton's `TRITON_INTERPRET`, ...)
are not settings and are asked for where they act.
Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from ouro_cli import env
from ouro_cli.config import P_EXEC, leaves, option
from ouro_cli.errors import SettingError
from ouro_cli.kernels import interpreted, triton_available

NEEDS_KERNEL_DEVICE = "needs CUDA (or the Triton interpreter, TRITON_INTERPRET=1)"


@dataclass(frozen=True)
class ExecutionSettings:
    compile: Literal["auto", "off", "always"] = option(
        "auto",
        help="torch.compile of the elementwise layer math: auto (on CUDA), off, or always (CPU too).",
        panel=P_EXEC,
        env="OURO_COMPILE",
    )
    compile_layers: Literal["auto", "on", "off"] = option(
        "auto",
        help="Where it compiles, each layer call of the replay as one compiled region: auto (unless "
        "--replay-attention paged), on, or off (function by function).",
        panel=P_EXEC,
        env="OURO_COMPILE_LAYERS",
    )
    decode_attention: Literal["auto", "torch", "triton"] = option(
        "auto",
        help="The decode step's KV write and attention: auto (one Triton kernel on CUDA), torch (the "
        "reference), or triton.",
        panel=P_EXEC,
        env="OURO_DECODE_ATTENTION",
    )
    decode_gemv: Literal["auto", "cublas", "triton"] = option(
        "auto",
        help="The decode step's projections: auto (the Triton small-batch matmul on CUDA where it was "
        "measured faster), cublas, or triton (every product of up to 64 rows).",
        panel=P_EXEC,
        env="OURO_DECODE_GEMV",
    )
    replay_attention: Literal["sdpa", "paged"] = option(
        "sdpa",
        help="The replay's and the prefill's attention: sdpa, or paged (the decode kernel's reduction "
        "order for every query: slower, for engine-trainer agreement to the bit; CUDA).",
        panel=P_EXEC,
        env="OURO_REPLAY_ATTENTION",
    )
    exact: bool = option(
        False,
        help="Batch-invariant kernels everywhere (docs/exact.md): engine and trainer compute every "
        "logprob with the same bits, in bf16 too; slower. Chooses the kernels itself.",
        panel=P_EXEC,
    )
    kv_cache_dtype: Literal["auto", "bf16", "fp8"] = option(
        "auto",
        help="The KV cache's dtype: auto or bf16 (the model's dtype, unquantized; bf16 needs a bf16 "
        "model), or fp8 (e4m3 with a scale per token and head: 144 bytes per token and head instead "
        "of 256 at head_dim 128, about 1.8x the tokens; its decode speed and the demo's learning: "
        "docs/performance.md; the trainer's replay rounds its K/V the same way, docs/model.md §3).",
        panel=P_EXEC,
    )

    def __post_init__(self) -> None:
        for name, leaf in leaves(ExecutionSettings).items():
            allowed = getattr(leaf.type, "__args__", None)
            if allowed is None:
                if not isinstance(getattr(self, name), bool):
                    raise SettingError(f"{leaf.flag} must be true or false, got {getattr(self, name)!r}")
                continue
            if getattr(self, name) not in allowed:
                raise SettingError(
                    f"{leaf.flag} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {getattr(self, name)!r}"
                )
        if self.compile_layers == "on" and self.replay_attention == "paged":
            raise SettingError(
                "--compile-layers on does not combine with --replay-attention paged (its Triton "
                "launch is not traced); leave --compile-layers at auto"
            )
        if self.exact:  # the kernels are its own; compiling is off (`compiles`)
            given = [
                leaf.flag
                for name, leaf in leaves(ExecutionSettings).items()
                if name in ("decode_attention", "decode_gemv", "replay_attention")
                and getattr(self, name) != leaf.default
            ]
            given += ["--compile always"] * (self.compile == "always") + ["--compile-layers on"] * (
                self.compile_layers == "on"
            )
            if given:
                raise SettingError(
                    f"--exact chooses its kernels itself and runs eager (docs/exact.md): drop {given[0]}"
                )

    # ---- what they select -----------------------------------------------------------

    def compiles(self, device_type: str) -> bool:
        """Whether the elementwise math on a tensor of `device_type` runs compiled (never with
        `exact`: eager is one code for every shape, on both sides)."""
        if self.exact:
            return False
        return self.compiles_gradients(device_type)

    def compiles_gradients(self, device_type: str) -> bool:
        """Whether backward-only math (exact mode's row-function pullbacks, whose gradients need
        no fixed order) runs compiled on `device_type`: as the forward would without `exact`."""
        return self.compile == "always" or (self.compile == "auto" and device_type == "cuda")

    @property
    def layer_regions(self) -> bool:
        """Whether, where the math compiles, each replay layer call compiles as one region
        (model/pointwise.py `region`)."""
        return self.compile_layers == "on" or (self.compile_layers == "auto" and self.replay_attention != "paged")

    def decode_attention_on(self, device_type: str) -> str:
        """The decode attention path on `device_type`: "torch", "triton", or with `exact` on CPU
        "exact" (model/exact.py; on CUDA exact mode runs the Triton kernel)."""
        if self.exact:
            if not exact_kernels(device_type):
                return "exact"
            if not triton_available():
                raise SettingError("--exact on CUDA needs the triton package (pip install triton)")
            return "triton"
        if self.decode_attention == "auto":
            return "triton" if device_type == "cuda" and triton_available() else "torch"
        if self.decode_attention == "triton" and not triton_available():
            raise SettingError("--decode-attention triton needs the triton package (pip install triton)")
        return self.decode_attention

    def decode_gemv_on(self, device_type: str) -> str:
        """The decode projections' path on `device_type`: "cublas" (F.linear), "auto" (the kernel
        where it is faster, kernels/gemv.py) or "triton"."""
        if self.exact:
            return "exact"
        if self.decode_gemv == "auto" and (device_type != "cuda" or not triton_available()):
            return "cublas"
        if self.decode_gemv == "triton" and not triton_available():
            raise SettingError("--decode-gemv triton needs the triton package (pip install triton)")
        return self.decode_gemv

    def decode_gemv_kernel(self, device_type: str):
        """The small-batch matmul the engine's decode step hands the model (model/matmul.py), or
        None for F.linear (cuBLAS on CUDA)."""
        path = self.decode_gemv_on(device_type)
        if path in ("cublas", "exact"):  # exact: model/matmul.py routes every product itself
            return None
        from ouro_cli.kernels.gemv import small_m_linear, small_m_linear_where_faster

        return small_m_linear if path == "triton" else small_m_linear_where_faster

    def replay_attention_on(self, device_type: str) -> str:
        """The whole-sequence forward's attention on `device_type`: "sdpa", "paged", or with
        `exact` "exact" on CPU (model/exact.py) and "paged" on CUDA (the decode kernel's order)."""
        if self.exact:
            return "paged" if exact_kernels(device_type) else "exact"
        return self.replay_attention

    @property
    def fp8_kv(self) -> bool:
        """Whether K/V are rounded to fp8 (model/kv_quant.py): by every layer call, engine and
        trainer alike, and stored so in the engine's cache."""
        return self.kv_cache_dtype == "fp8"

    def check_model_dtype(self, bf16: bool) -> None:
        """A SettingError where the cache's dtype cannot hold a model computing in bf16 (`bf16`)
        or fp32: `bf16` names the unquantized cache, which holds the model's dtype."""
        if self.kv_cache_dtype == "bf16" and not bf16:
            raise SettingError(
                "--kv-cache-dtype bf16 keeps K/V in the model's dtype, and this model computes in fp32: "
                "pass --kv-cache-dtype auto (or fp8)"
            )

    def effective(self, device_type: str) -> dict[str, str]:
        """What these settings compute with on `device_type`: the record of the run's contract.
        Two settings that compute the same there record the same."""
        compiled = self.compiles(device_type)
        return {
            "compile": "on" if compiled else "off",
            "compile_layers": "on" if compiled and self.layer_regions else "off",
            "decode_attention": self.decode_attention_on(device_type),
            "decode_gemv": self.decode_gemv_on(device_type),
            "replay_attention": self.replay_attention_on(device_type),
            "exact": "on" if self.exact else "off",
            "kv_cache_dtype": "fp8" if self.fp8_kv else "model",
        }

    def check(self, device_type: str) -> None:
        """Everything that cannot run on `device_type`, as one SettingError before any model loads."""
        if self.exact:  # torch on CPU; on CUDA its Triton kernels, which need triton
            self.decode_attention_on(device_type)
            return
        kernel_device = device_type == "cuda" or interpreted()
        if self.decode_attention_on(device_type) == "triton" and not kernel_device:
            raise SettingError(f"--decode-attention triton {NEEDS_KERNEL_DEVICE}")
        if self.decode_gemv_on(device_type) != "cublas" and not kernel_device:
            raise SettingError(f"--decode-gemv {self.decode_gemv} {NEEDS_KERNEL_DEVICE}")
        if self.replay_attention == "paged" and not kernel_device:
            raise SettingError(f"--replay-attention paged runs a Triton kernel: it {NEEDS_KERNEL_DEVICE}")


def chosen_settings(
    current: ExecutionSettings, execution: ExecutionSettings | None, exact: bool | None
) -> ExecutionSettings:
    """A model's settings once its user has spoken (`LLM` and `Trainer` take both): `execution`
    in place of `current` where given, then `exact` on or off in them where given."""
    settings = current if execution is None else execution
    return settings if exact is None else replace(settings, exact=exact)


DEFAULTS = ExecutionSettings()
_local = threading.local()  # .settings: the ExecutionSettings this thread computes under


@contextlib.contextmanager
def executing(settings: ExecutionSettings) -> Iterator[None]:
    """Compute under `settings` inside the block (per thread): the model's elementwise math
    (model/pointwise.py), its products and attention read them through `active_settings`."""
    before = getattr(_local, "settings", None)
    _local.settings = settings
    try:
        yield
    finally:
        _local.settings = before


def active_settings() -> ExecutionSettings:
    """The settings of the block this thread runs in (`executing`), else the defaults; never
    the environment."""
    return getattr(_local, "settings", None) or DEFAULTS


def under(fn: Callable, settings: ExecutionSettings) -> Callable:
    """`fn` that runs under `settings` whenever it is called: for a function called again
    outside the block that made it (activation recompute re-runs a layer call in backward)."""

    def run(*args):
        with executing(settings):
            return fn(*args)

    return run


def exact_kernels(device_type: str) -> bool:
    """Whether exact mode on `device_type` runs its Triton kernels (CUDA, or anywhere under the
    Triton interpreter, as the CPU tests of that path do) or its torch code (model/exact.py)."""
    return device_type == "cuda" or interpreted()


def from_environment(root: type) -> dict[str, Any]:
    """The values the environment gives the options of the tree `root` that declare a variable,
    by flat name; a value that is not one of the option's is a SettingError naming the variable."""
    values: dict[str, Any] = {}
    for name, leaf in leaves(root).items():
        variable = leaf.info.env
        text = env.get(variable) if variable else None
        if text is None:
            continue
        value: Any = text
        allowed = getattr(leaf.type, "__args__", None)
        if leaf.type is int:
            try:
                value = int(text)
            except ValueError:
                raise SettingError(f"{variable}={text!r}: {leaf.flag} must be an integer") from None
        elif allowed is not None and text not in allowed:
            raise SettingError(f"{variable}={text!r}: must be one of {', '.join(allowed)} (the option {leaf.flag})")
        values[name] = value
    return values


def variables(root: type) -> dict[str, str]:
    """Flat option name -> its environment variable, for the options of `root` that have one."""
    return {name: leaf.info.env for name, leaf in leaves(root).items() if leaf.info.env}
