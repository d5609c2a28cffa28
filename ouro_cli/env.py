"""Every environment variable ouro reads or sets, declared once: its meaning, type and default.

This module is the one place that touches `os.environ` (tests/unit/test_structure.py checks
it); the rest of the package asks it: `rank()`, `local_rank()`, `world_size()`, `debug()`,
or `get(NAME)` for any variable of `VARIABLES`. A variable that is unset or empty reads as
its default. A switch that changes what a run computes is an option, not a variable: the
options that the environment may give when neither a flag nor the TOML file does
(`option(env=...)`, ouro_cli/config.py) are listed here too, as their text, which their
option parses and checks (ouro_cli/settings.py `from_environment`).

To add a variable, add its line to `VARIABLES`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _flag(text: str) -> bool:
    return text != "0"


def _is_one(text: str) -> bool:
    return text == "1"


@dataclass(frozen=True)
class Variable:
    parse: Callable[[str], Any]
    default: Any
    meaning: str
    test_only: bool = False


OPTION = "when neither a flag nor the TOML file gives it (the option checks the text)"

VARIABLES: dict[str, Variable] = {
    # set by the launcher (torchrun)
    "RANK": Variable(int, 0, "this process's rank in the job"),
    "LOCAL_RANK": Variable(int, 0, "its rank on this host: the index of the CUDA device it uses"),
    "WORLD_SIZE": Variable(int, 1, "how many processes the job has"),
    # ouro's own
    "OURO_DEBUG": Variable(
        _flag,
        False,
        "a failing command shows its traceback (`ouro --debug` sets it, so that "
        "the processes a command starts show theirs)",
    ),
    "OURO_CHECK_KERNELS": Variable(
        _flag,
        False,
        "the Triton kernels check the indices they dereference before each "
        "launch (kernels/bounds.py): a debugging aid that reads the device",
    ),
    # options (ouro_cli/settings.py, rl/options.py)
    "OURO_COMPILE": Variable(str, None, f"--compile {OPTION}"),
    "OURO_COMPILE_LAYERS": Variable(str, None, f"--compile-layers {OPTION}"),
    "OURO_DECODE_ATTENTION": Variable(str, None, f"--decode-attention {OPTION}"),
    "OURO_DECODE_GEMV": Variable(str, None, f"--decode-gemv {OPTION}"),
    "OURO_REPLAY_ATTENTION": Variable(str, None, f"--replay-attention {OPTION}"),
    "OURO_PD_TRANSPORT": Variable(str, None, f"--kv-transport {OPTION}"),
    "OURO_PD_THREADS": Variable(str, None, f"--pd-worker-threads {OPTION}"),
    # other programs' variables
    "TRITON_INTERPRET": Variable(_is_one, False, "Triton runs its kernels on its CPU interpreter (Triton's own)"),
    "XDG_CACHE_HOME": Variable(
        str, None, "the user's cache directory: compiled kernels go to its ouro/ (default ~/.cache/ouro)"
    ),
    "TORCHINDUCTOR_CACHE_DIR": Variable(
        str, None, "torch.compile's cache: set, unless set, to the cache's ouro/inductor (warnings_log.quiet)"
    ),
    "TRITON_CACHE_DIR": Variable(str, None, "Triton's cache: set, unless set, to the cache's ouro/triton"),
    "CUBLAS_WORKSPACE_CONFIG": Variable(
        str, None, "cuBLAS's workspace: set, unless set, where deterministic kernels need it (trainer/determinism.py)"
    ),
    "PYTORCH_CUDA_ALLOC_CONF": Variable(
        str,
        None,
        "PyTorch's CUDA allocator settings: set, unless set, to expandable segments in a colocated run "
        "(rl/allocator.py)",
    ),
    "UCX_TLS": Variable(
        str, None, "the UCX transports NIXL may use: set in `ouro probe-ucx`'s processes, one setting each"
    ),
    # test-only: ouro_cli/testing/faults.py, never set in a real run
    "OURO_TEST_FAULT": Variable(
        str,
        None,
        "POINT[@N]=ACTION[+ACTION]: a signal, a device error or a memory hog at a named point",
        test_only=True,
    ),
    "OURO_TEST_BREAK_RESUME": Variable(
        _flag, False, "a resumed run reseeds its sampler (a broken resume)", test_only=True
    ),
    "OURO_TEST_KV_LIMIT": Variable(
        int, None, "a KV cache of more than N blocks is out of memory (a small device)", test_only=True
    ),
    "OURO_TEST_TRAIN_LIMIT": Variable(
        int, None, "a micro-batch of more than N tokens is out of memory (a small device)", test_only=True
    ),
}


def get(name: str) -> Any:
    """The value of the declared variable `name`: parsed, or its default where unset or empty."""
    variable = VARIABLES[_declared(name)]
    text = os.environ.get(name, "")
    return variable.parse(text) if text else variable.default


def is_set(name: str) -> bool:
    """Whether the declared variable `name` is in the environment (even empty)."""
    return _declared(name) in os.environ


def set_default(name: str, value: str) -> None:
    """Set the declared variable `name` for this process and those it starts, unless it is set."""
    os.environ.setdefault(_declared(name), value)


def put(name: str, value: str | None) -> None:
    """Set the declared variable `name` for this process and those it starts (None: remove it)."""
    if value is None:
        os.environ.pop(_declared(name), None)
    else:
        os.environ[_declared(name)] = value


def _declared(name: str) -> str:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in ouro_cli/env.py VARIABLES")
    return name


def rank() -> int:
    return get("RANK")


def local_rank() -> int:
    return get("LOCAL_RANK")


def world_size() -> int:
    return get("WORLD_SIZE")


def launched_by_torchrun() -> bool:
    return is_set("RANK") and is_set("WORLD_SIZE")


def debug() -> bool:
    return get("OURO_DEBUG")
