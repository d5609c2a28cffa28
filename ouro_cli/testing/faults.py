"""Test-only fault injection, kept out of the options a user sees: nothing here changes a
run unless a test asks for it through the test-only variables below (declared in ouro_cli/env.py).

Signals at named points (`OURO_TEST_FAULT`): the kill-test harness
(tests/integration/test_kill_resume.py) must interrupt a run at exact places, not at a
time that may fall anywhere. Code that has such a place calls `point(name)`; nothing
happens unless `OURO_TEST_FAULT` names it.

    OURO_TEST_FAULT="POINT[@N]=ACTION[+ACTION...]"

carries out the actions, in order, the N-th time (default 1) this process reaches POINT: a signal's
name sends it to this process.
`rollout@3=TERM` sends SIGTERM at the end of the third update's rollout; `save.renamed=KILL`
SIGKILLs the first save between the rename of its iteration and the tracker write;
`rollout@2=INT+INT` sends two SIGINTs at once (the second one stops at once). The action
`CUDA` raises a device error instead: on a CUDA device a real one (an out-of-bounds index,
a device-side assert that leaves the CUDA context unusable), elsewhere a RuntimeError worded
as CUDA words it; `generate@2=CUDA` fails the second rollout's generate call. The action
`HOG<GiB>` takes that much device memory, as another process on the GPU would, and holds it
until the rollout ends (`rollout`); `HOG-<GiB>` takes all the free memory but that much.
`generate@2=HOG100` leaves the second rollout's KV cache short, so the run's out-of-memory
recovery must act on a real allocation failure.

Points: `command` (a command's body starts: nothing imported for it yet), `evaluation` (a
run's held-out evaluation starts), `generate` (a rollout's generate call starts, inside the
rollout phase), `rollout` (the engine has sampled, nothing has trained),
`save.staged` (a save has written every file of `iter_N.staging/`, nothing is committed),
`save.renamed` (`iter_N/` is complete and in place, the tracker still names the previous
iteration, or nothing for a first save), `save.tracker` (the tracker names `iter_N`; older
iterations not yet pruned).

A broken resume (`OURO_TEST_BREAK_RESUME=1`, `broken_resume`): a resumed run draws its
samples with another seed, the kind of bug `ouro verify-resume` exists to catch
(tests/integration/test_verify_resume_cli.py checks that it does).

A device too small (`OURO_TEST_KV_LIMIT=N`, `simulated_device_limit`): a generate call whose
KV cache would hold more than N blocks' worth of memory (blocks counted at T planes) raises
an out-of-memory error, as a device with too little free memory would, in every process
alike; the recovery tests (tests/integration/test_oom_recovery.py) drive the run's
out-of-memory recovery with it. Its train-step twin (`OURO_TEST_TRAIN_LIMIT=N`,
`simulated_train_limit`): a training micro-batch of more than N positions (padding included)
raises an out-of-memory error after its forward pass, before its backward, so that the
micro-batches before it in the step have accumulated their gradients, as a real failure
midway through a step leaves them.

PD worker faults (`pd_faults`): the PD engine's tests make a worker fail or stall
(tests/unit/engine/test_pd.py); the coordinator hands what is set here to its workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from ouro_cli import env

ENV = "OURO_TEST_FAULT"
DEVICE_ERROR = "CUDA"
HOG = "HOG"
BREAK_RESUME_ENV = "OURO_TEST_BREAK_RESUME"
POINTS = ("command", "evaluation", "generate", "rollout", "save.staged", "save.renamed", "save.tracker")


def _action(word: str) -> signal.Signals | str:
    word = word.strip().upper()
    if word == DEVICE_ERROR or (word.startswith(HOG) and word[len(HOG) :].lstrip("-").replace(".", "", 1).isdigit()):
        return word
    return signal.Signals[f"SIG{word}"]


def _parse(spec: str | None) -> tuple[str, int, list[signal.Signals | str]] | None:
    if not spec:
        return None
    where, _, what = spec.partition("=")
    name, _, hit = where.partition("@")
    if name not in POINTS or not what:
        raise ValueError(f"{ENV}={spec!r}: expected POINT[@N]=ACTION[+ACTION], POINT one of {', '.join(POINTS)}")
    return name, int(hit or 1), [_action(word) for word in what.split("+")]


_FAULT = _parse(env.get(ENV))
_reached: Counter[str] = Counter()
_held: list[Any] = []  # the HOG action's device memory, until the rollout ends


def point(name: str, device: Any = None) -> None:
    """A place where the harness may stop this process (or fail its `device`); a no-op in
    every real run."""
    if name == "rollout":
        _held.clear()
    if _FAULT is None or _FAULT[0] != name:
        return
    _reached[name] += 1
    if _reached[name] == _FAULT[1]:
        for action in _FAULT[2]:
            if action == DEVICE_ERROR:
                device_error(device)
            elif isinstance(action, str):
                hog(device, float(action[len(HOG) :]))
            else:
                os.kill(os.getpid(), action)


def hog(device: Any, gib: float) -> None:
    """Take `gib` GiB of `device`'s memory (`gib` < 0: all that is free but -`gib` GiB) and
    hold it until the rollout ends; on a device other than CUDA, nothing (the simulated
    device of `OURO_TEST_KV_LIMIT` serves there)."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        size = int(gib * 2**30) if gib >= 0 else torch.cuda.mem_get_info(device)[0] + int(gib * 2**30)
        _held.append(_foreign_memory(torch.device(device), max(0, size)))


def _foreign_memory(device: Any, size: int) -> Any:
    """`size` bytes of `device` taken past PyTorch's allocator, as another process takes them, so
    that the allocator's cap (rl/allocator.py) does not count them; through the allocator where
    NVIDIA's cuda-bindings is missing. Freed when the returned object is dropped."""
    import weakref

    import torch

    try:
        from cuda.bindings import runtime
    except ImportError:
        return torch.empty(size, dtype=torch.uint8, device=device)
    with torch.cuda.device(device):
        err, pointer = runtime.cudaMalloc(size)
    if err != runtime.cudaError_t.cudaSuccess:
        raise torch.OutOfMemoryError(f"the test's memory hog could not take {size / 2**30:.1f} GiB ({err})")

    class Held:  # a handle whose finalizer frees the memory
        pass

    held = Held()
    weakref.finalize(held, runtime.cudaFree, pointer)
    return held


def device_error(device: Any) -> None:
    """A device error as a bad kernel gives one: on CUDA an out-of-bounds index (a device-side
    assert), read back so that it surfaces here; elsewhere its message, simulated."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        table = torch.zeros(4, device=device)
        table[torch.tensor([1 << 40], device=device)].sum().item()
    raise RuntimeError(f"CUDA error: an illegal memory access was encountered ({ENV} simulated it)")


def broken_resume() -> bool:
    """Whether a resumed run should reseed its sampler (a deliberately broken resume)."""
    return env.get(BREAK_RESUME_ENV)


_pd_faults: dict[str, dict[str, Any]] = {}


@contextlib.contextmanager
def pd_faults(faults: Mapping[str, Mapping[str, Any]]) -> Iterator[None]:
    """PD engines started inside the block give worker `name` the faults `faults[name]`
    (engine/pd/worker.py: `fail_update_version`, `hang_on_prefill`)."""
    before = dict(_pd_faults)
    _pd_faults.clear()
    _pd_faults.update({name: dict(f) for name, f in faults.items()})
    try:
        yield
    finally:
        _pd_faults.clear()
        _pd_faults.update(before)


def pd_fault(worker: str) -> dict[str, Any]:
    """The faults set for PD worker `worker` (P0, D0, ...); empty in every real run."""
    return dict(_pd_faults.get(worker, {}))


KV_LIMIT_ENV = "OURO_TEST_KV_LIMIT"
_KV_LIMIT = env.get(KV_LIMIT_ENV)


def simulated_device_limit(blocks: int, planes: int, num_loops: int) -> None:
    """Raise torch.OutOfMemoryError where a call's cache of `blocks` blocks at `planes` planes
    would exceed the simulated device (`OURO_TEST_KV_LIMIT`); a no-op in every real run."""
    if _KV_LIMIT is not None and blocks * planes > _KV_LIMIT * num_loops:
        import torch

        raise torch.OutOfMemoryError(
            f"{KV_LIMIT_ENV}: {blocks} KV blocks at {planes} planes do not fit the simulated "
            f"device ({_KV_LIMIT} at {num_loops})"
        )


TRAIN_LIMIT_ENV = "OURO_TEST_TRAIN_LIMIT"
_TRAIN_LIMIT = env.get(TRAIN_LIMIT_ENV)


def simulated_train_limit(tokens: int) -> None:
    """Raise torch.OutOfMemoryError where a training micro-batch of `tokens` positions would
    exceed the simulated device (`OURO_TEST_TRAIN_LIMIT`); a no-op in every real run."""
    if _TRAIN_LIMIT is not None and tokens > _TRAIN_LIMIT:
        import torch

        raise torch.OutOfMemoryError(
            f"{TRAIN_LIMIT_ENV}: a micro-batch of {tokens} tokens does not fit the simulated device ({_TRAIN_LIMIT})"
        )
