"""`ouro train` with torch.profiler around one update's train step: where the job's train phase goes.

    python bench/train_step_profile.py UPDATE OUT.txt train --model ... (ouro train's arguments)

Runs the command line exactly as `python -m ouro_cli.cli.app` does, with the trainer's
`train_update` profiled at its UPDATE-th call (0-based: the train step of update UPDATE), and
writes to OUT.txt the step's wall time against the device's busy time (their gap is host time
or waits for the device), then on CUDA the busy time per kernel family and the top kernels,
the device's idle gaps by the host operation whose launch the device waited for (where a
step bound by the host's launch work loses its time), the host's waits for the device by the
ouro_cli line that caused them, and the top operators by own CPU time. bench/e2e.py
`--train-profile UPDATE` runs it and prints the file.

What it is for: bench/e2e.py's train phase at 256 × 512 runs slower than its device time
allows (docs/performance.md#train), and bench/train_step.py cannot
replay that phase: its trainer lacks the run's memory plan (gradients freed between steps,
the cache's memory handed back) and runs out of memory at the run's micro-batch budget. Only
the profiled step slows down.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from train_host_profile import run_ouro, wrap_call  # noqa: E402  (bench/: the same wrapping of a call)


def profile_call(update: int, out: str, top: int = 30) -> None:
    """Wrap Trainer.train_update so that its `update`-th call runs under torch.profiler, the
    summary written to `out`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ouro_cli.trainer.trainer import Trainer

    def around(trainer, call):
        cuda = trainer.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, with_stack=True) as prof, sync_stacks(cuda) as stacks:
            start = time.perf_counter()
            result = call()
            if cuda:
                torch.cuda.synchronize(trainer.device)
            wall = time.perf_counter() - start
        Path(out).write_text(summary(prof, wall, cuda, top, stacks))
        return result

    wrap_call(Trainer, "train_update", update, around)


@contextlib.contextmanager
def sync_stacks(cuda: bool):
    """Inside the block, every operation that makes the host wait for the device (PyTorch's
    sync debug mode: `.item()`, a blocking copy, `nonzero`, ...) is recorded with the Python
    stack of the thread that made it, innermost frames last; yields the Counter of stacks
    (the last STACK_DEPTH frames outside torch, as "file:line function")."""
    import traceback
    import warnings
    from collections import Counter

    import torch

    stacks: Counter = Counter()
    if not cuda:
        yield stacks
        return

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if "/torch/" not in f.filename
            and "/warnings.py" not in f.filename
            and Path(f.filename).name != Path(__file__).name
        ]
        stacks[tuple(f"{short(f.filename)}:{f.lineno} {f.name}" for f in frames[-STACK_DEPTH:])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown, warnings.showwarning = warnings.showwarning, record
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield stacks
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = shown


STACK_DEPTH = 4


def short(filename: str) -> str:
    """A source path from its package folder on (ouro_cli/..., megatron/...)."""
    for root in ("ouro_cli/", "megatron/", "bench/"):
        if root in filename:
            return root + filename.split(root, 1)[1]
    return Path(filename).name


def summary(prof, wall: float, cuda: bool, top: int, stacks=None) -> str:
    import io

    from kernel_table import cuda_kernels, print_kernel_table

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print(f"train step: {wall:.2f} s wall")
        if cuda:
            kernels = cuda_kernels(prof)
            busy = print_kernel_table(kernels, top, indent="  ")
            print(f"  GPU busy {busy / 1e6:.2f} s = {busy / 1e6 / wall:.1%} of the wall time")
            print_idle_gaps(kernels, prof.events(), top)
            print_syncs(prof, top)
            print_sync_stacks(stacks or {}, top)
        print("  operators by own CPU time:")
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
        print("\n".join("    " + line for line in table.splitlines()))
    return text.getvalue()


GAP_US = 5.0  # device idle for longer than this between kernels counts as a gap
LAUNCHES = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaMemsetAsync",
    "cudaMemcpyAsync",
)


def idle_gaps(kernels, events, gap_us: float = GAP_US):
    """Where the device sat idle: every stretch of more than `gap_us` µs with no kernel running
    on any stream, charged to the host launch call (cudaLaunchKernel, ...) last begun before the
    kernel after it started (the device waited for that launch), by that call's outermost aten
    operator and the innermost ouro_cli line on its Python stack. Matched by time: the profiler's
    events carry no usable link from a kernel to its launch (a link by event id charged every gap
    of the H200 profile to the profiler's own "Activity Buffer Request").
    -> (Counter of µs by (operator, line), Counter of gaps by the same, total idle µs)."""
    import bisect
    from collections import Counter

    import torch

    launches = sorted(
        (e for e in events if e.device_type != torch.autograd.DeviceType.CUDA and e.name in LAUNCHES),
        key=lambda e: e.time_range.start,
    )
    starts = [e.time_range.start for e in launches]
    idle: Counter = Counter()
    count: Counter = Counter()
    ordered = sorted(kernels, key=lambda k: k.time_range.start)
    busy_until = ordered[0].time_range.end if ordered else 0.0
    for kernel in ordered[1:]:
        gap = kernel.time_range.start - busy_until
        if gap > gap_us:
            at = bisect.bisect_right(starts, kernel.time_range.start) - 1
            key = _launcher(launches[at] if at >= 0 else None)
            idle[key] += gap
            count[key] += 1
        busy_until = max(busy_until, kernel.time_range.end)
    return idle, count, sum(idle.values())


def _launcher(op) -> tuple[str, str]:
    """(outermost aten operator, innermost ouro_cli line) of the op that launched a kernel."""
    return ("(launcher not recorded)", "") if op is None else _source(op, op.name)


def _source(op, outermost: str) -> tuple[str, str]:
    """(the outermost aten operator from `op` up its parents, else `outermost`; the innermost
    ouro_cli line on the first of them with one on its Python stack)."""
    frames = []
    while op is not None:
        if op.name.startswith("aten::"):
            outermost = op.name
        if not frames:
            frames = [f for f in (op.stack or []) if "ouro_cli" in f]
        op = op.cpu_parent
    return outermost, frames[0].split("ouro_cli/")[-1] if frames else "(no ouro_cli line: backward or a library)"


def print_idle_gaps(kernels, events, top: int) -> None:
    idle, count, total = idle_gaps(kernels, events)
    print(
        f"  device idle in gaps over {GAP_US:.0f} µs: {total / 1e6:.2f} s in {sum(count.values())} gaps; "
        f"by the launch the device waited for:"
    )
    for key, us in idle.most_common(top):
        print(f"    {us / 1e3:9.2f} ms  {count[key]:6d} gaps  {key[0]}  {key[1]}")


def print_syncs(prof, top: int) -> None:
    """The host's waits for the device (cudaStreamSynchronize, and cudaMemcpyAsync, where a copy
    to pageable host memory waits: `.item()`, `int(t)`, `nonzero`, a blocking copy), by the outermost operator that
    made them and the innermost ouro_cli line on
    its Python stack, with the time the host waited: each is a point where the device's queue
    ran dry behind it. Waits inside the backward have no Python stack (the autograd engine
    runs them): their operator names them (an index_put_ under deterministic algorithms,
    say)."""
    from collections import Counter

    count: Counter = Counter()
    waited: Counter = Counter()
    for event in prof.events():
        if event.name not in ("cudaStreamSynchronize", "cudaMemcpyAsync"):
            continue
        key = _source(event.cpu_parent, "(no operator)")
        count[key] += 1
        waited[key] += event.cpu_time_total
    print(f"  syncs and copies: {sum(count.values())}, {sum(waited.values()) / 1e6:.2f} s of host time; by source:")
    for key, n in count.most_common(top):
        print(f"    {n:6d} x {waited[key] / n / 1e3:7.3f} ms  {key[0]}  {key[1]}")


def print_sync_stacks(stacks, top: int) -> None:
    """The host's waits by the Python stack that made them (`sync_stacks`), most frequent first;
    a wait with no Python frame outside torch ran inside the backward's C++."""
    print(f"  host waits by Python stack (sync debug mode): {sum(stacks.values())}")
    for frames, n in sorted(stacks.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {n:6d} x  " + (" <- ".join(reversed(frames)) if frames else "(no Python frame outside torch)"))


def main() -> None:
    run_ouro(__doc__, profile_call)


if __name__ == "__main__":
    main()
