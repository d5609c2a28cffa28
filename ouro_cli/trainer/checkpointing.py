"""Trainer checkpoints: the full training state as one megatron-core dist checkpoint.

    ROOT/
      latest_checkpointed_iteration.txt
      iter_0000007/              megatron dist checkpoint (torch_dist) + trainer_state.json + COMPLETE
      hf_assets/config.json      the model config, so ROOT also reads as a model checkpoint

Inside the dist checkpoint:
- `model`: ShardedTensors keyed by the physical HF names (incl. the frozen exit gate),
  so `ouro_cli.checkpoint` reads the model out of a trainer checkpoint unchanged;
- `optimizer`: main weights, Adam moments (Megatron's own sharded format; the
  distributed optimizer uses "dp_reshardable", the one that saves);
- common state (written once by rank 0): scheduler state, Adam step counts (restored
  by hand: the distributed optimizer's loader resets them to 0), the iteration and the
  caller's `extra` dict (data cursor, update id; JSON only, also in trainer_state.json);
- `rng`: one ShardedObject per rank (Python, NumPy, torch CPU/CUDA, Megatron tracker).

Failures (`check_disk`, `failure_guard`): before anything is written, the ranks check that the disk has room
for the checkpoint (its size is known: every model, main-weight and Adam tensor, plus a
margin) and refuses with one line naming the bytes needed and free. A save that fails
anyway (a full disk, a permission, a killed writer process, whose megatron error names
none of these) is reported as one `ResourceError` naming the cause; its staging
directory is removed and the previous iteration stays the latest.

Background saves (`async_save`): megatron's async writer copies the tensors off the
device when the save is scheduled and writes them in a helper process while training
goes on; `finish` waits for it and commits. The commit is the same as a synchronous
save's, so a process killed before it leaves the previous iteration latest.

Validity (ouro_cli.checkpoint.layout): everything is written under `iter_N.staging/`,
then the staging directory is marked complete, renamed and the tracker rewritten, all
by rank 0 after every rank finished writing. A process killed at any point before the
tracker moves leaves the previous iteration as latest; older iterations are pruned
only after that (keep_last). A synchronous save writes its files in forked writer processes
and keeps their results in process (ouro_cli.mcore.sync_save); a background save's results go
through a spawned helper process that re-imports `__main__`: a script that saves in the
background needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ouro_cli.checkpoint import layout
from ouro_cli.errors import Interrupted, ResourceError, UserError
from ouro_cli.mcore.sync_save import in_process_results

from . import rng
from .optimizer import adam_steps, init_optimizer_state, set_adam_steps

# The only distributed-optimizer format that saves on megatron-core 0.16 (docs/architecture.md §5).
CONTENT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
STATE_FILE = "trainer_state.json"


def _state(module, optimizer, scheduler, *, is_loading: bool, iteration=None, extra=None, rng_state=None) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    model_state = module.sharded_state_dict()
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=CONTENT_METADATA),
        "rng": ShardedObject("rng_state", rng_state, (world,), (rank,), replica_id=0),
        "scheduler": scheduler.state_dict(),
        "adam_steps": adam_steps(optimizer),
        "iteration": iteration,
        "world_size": world,
        "extra": extra,
    }


@dataclass
class PendingSave:
    """A checkpoint that megatron's async writer is still writing (`save(..., async_save=True)`):
    the tensors were copied off the device when it was scheduled, so training may go on and
    change them; `finish` waits for the writer and commits the iteration. Until then the
    previous iteration stays the latest."""

    root: Path
    iteration: int
    queue: Any  # megatron's AsyncCallsQueue
    commit: Callable[[], Path]
    where: Path
    need: int


def save(
    root: Path,
    iteration: int,
    *,
    module,
    optimizer,
    scheduler,
    on_cuda: bool,
    extra: dict | None,
    keep_last: int | None,
    before_commit: Callable[[Path], None] | None = None,
    async_save: bool = False,
) -> Path | PendingSave:
    """Write iteration `iteration` under `root` and make it the latest (collective call). With
    `async_save` the write goes on in the background: a `PendingSave` for `finish`."""
    root = Path(root)
    extra = dict(extra or {})
    try:
        extra_json = json.dumps(extra, sort_keys=True)
    except TypeError as err:
        raise UserError(f"checkpoint extra state must be JSON-serialisable: {err}") from err
    init_optimizer_state(optimizer)  # the distributed optimizer cannot save a state that does not exist
    where, need = check_disk(root, iteration, checkpoint_bytes(module, optimizer))
    with failure_guard(root, iteration, where, need):
        commit, request = _write(
            root,
            iteration,
            module=module,
            optimizer=optimizer,
            scheduler=scheduler,
            on_cuda=on_cuda,
            extra_json=extra_json,
            keep_last=keep_last,
            before_commit=before_commit,
            async_save=async_save,
        )
        if request is None:
            return commit()
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
    return PendingSave(root, iteration, queue, commit, where, need)


def finish(pending: PendingSave) -> Path:
    """Wait for a background save and commit it (collective call); a failed write is one
    `ResourceError` naming its cause, as for a synchronous save."""
    try:
        with failure_guard(pending.root, pending.iteration, pending.where, pending.need):
            pending.queue.maybe_finalize_async_calls(blocking=True)
            return pending.commit()
    finally:
        pending.queue.close()


def _write(
    root: Path,
    iteration: int,
    *,
    module,
    optimizer,
    scheduler,
    on_cuda: bool,
    extra_json: str,
    keep_last: int | None,
    before_commit: Callable[[Path], None] | None,
    async_save: bool,
) -> tuple[Callable[[], Path], Any]:
    """Write the dist checkpoint into `iter_N.staging/` (or schedule that write: the async
    request is returned) and return the commit that makes it iteration N; the commit's
    contents (trainer state, scheduler, Adam steps) are taken now, not when it runs."""
    from megatron.core import dist_checkpointing

    rank0 = dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        layout.staging_dir(root, iteration)  # fresh and empty (a leftover from a killed save is wiped)
        assets = root / layout.HF_ASSETS
        if not (assets / "config.json").is_file():
            assets.mkdir(exist_ok=True)
            module.ouro_config.save(assets)
    dist.barrier()
    staging = root / (layout.iteration_dir_name(iteration) + ".staging")
    state = _state(
        module,
        optimizer,
        scheduler,
        is_loading=False,
        iteration=iteration,
        extra=json.loads(extra_json),
        rng_state=rng.capture(on_cuda),
    )
    with contextlib.nullcontext() if async_save else in_process_results():
        request = dist_checkpointing.save(
            state,
            str(staging),
            sharded_strategy=_save_strategy(),
            content_metadata=CONTENT_METADATA,
            async_sharded_save=async_save,
            **_async_strategy(dist_checkpointing.save),
        )
    summary = {
        "iteration": iteration,
        "world_size": dist.get_world_size(),
        "scheduler": scheduler.state_dict(),
        "adam_steps": state["adam_steps"],
        "extra": json.loads(extra_json),
    }

    def commit() -> Path:
        dist.barrier()
        if rank0:
            (staging / STATE_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
            if before_commit is not None:
                before_commit(staging)
            layout.commit_iteration(root, iteration, keep_last=keep_last)
        dist.barrier()
        return root / layout.iteration_dir_name(iteration)

    return commit, request if async_save else None


def _async_strategy(save: Callable[..., Any]) -> dict[str, str]:
    """megatron-core's own background writer (`async_strategy="mcore"`) where `save` takes the
    choice: from 0.17 it defaults to NVIDIA Resiliency Extension's writer, which needs the
    `nvidia-resiliency-ext` package (without it every --async-save fails with
    ModuleNotFoundError); earlier versions have only megatron-core's."""
    import inspect

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(save).parameters else {}


def _save_strategy():
    """megatron's torch_dist writer with one thread per core up to 8 (its default is 2): the
    writer threads serialise and write a checkpoint's shards in parallel."""
    import os

    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=max(2, min(8, os.cpu_count() or 2)))


# What a checkpoint holds beyond its tensors (metadata, common state, RNG), and the margin a
# filesystem needs around a large write.
SAVE_MARGIN_BYTES = 16 * 2**20
SAVE_MARGIN_FRACTION = 0.05


def checkpoint_bytes(module, optimizer) -> int:
    """This rank's checkpoint size: model tensors, and every tensor of the optimizer's state
    (fp32 main weights, Adam moments) that the dist checkpoint writes."""
    from .optimizer import torch_optimizers

    total = sum(p.numel() * p.element_size() for p in module.parameters())
    for opt in torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.dtype == torch.float32 and any(p is q for q in module.parameters()):
                    continue  # fp32 params are their own main weights: written once, as the model
                total += p.numel() * p.element_size()
        for state in opt.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return int(total)


def check_disk(root: Path, iteration: int, nbytes: int) -> tuple[Path, int]:
    """Refuse a save the disk cannot hold (one line: the bytes needed and free) before anything
    is written; returns (the filesystem's existing directory, the bytes needed)."""
    need = torch.tensor([nbytes], dtype=torch.int64)
    if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        dist.all_reduce(need)
    elif dist.get_world_size() > 1:  # NCCL reduces device tensors
        need = need.cuda()
        dist.all_reduce(need)
    need_total = int(need.item())
    need_total += int(SAVE_MARGIN_FRACTION * need_total) + SAVE_MARGIN_BYTES
    where = _existing_parent(root)
    free = shutil.disk_usage(where).free
    if free < need_total:
        raise ResourceError(
            f"not enough disk space to save checkpoint {layout.iteration_dir_name(iteration)}: it "
            f"needs about {_gib(need_total)}, {where} has {_gib(free)} free; free some space, lower "
            f"--keep-last, or use a run directory on a larger disk ({what_remains(root)})"
        )
    return where, need_total


@contextlib.contextmanager
def failure_guard(root: Path, iteration: int, where: Path, need: int) -> Iterator[None]:
    """Turn any failure of a save into one line with its cause, leaving no staging directory
    behind (module docstring)."""
    name = layout.iteration_dir_name(iteration)
    try:
        yield
    except BaseException as err:  # torch DCP's CheckpointException is a BaseException
        passthrough = isinstance(err, KeyboardInterrupt | SystemExit | UserError | Interrupted)
        cause = None if passthrough else _save_failure(err, where, need)  # before the staging space is freed
        if dist.get_rank() == 0:
            shutil.rmtree(Path(root) / (name + ".staging"), ignore_errors=True)
        if passthrough:
            raise
        raise ResourceError(f"saving checkpoint {name} failed: {cause} ({what_remains(root)})") from err


def what_remains(root: Path) -> str:
    """What a save that failed leaves under `root`, in the words of its error line."""
    return "the last checkpoint is intact" if layout.is_megatron_checkpoint(root) else "no earlier checkpoint exists"


def _existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _save_failure(err: BaseException, where: Path, need: int) -> str:
    """The cause of a failed save in words: megatron's writers report a full disk as a
    "Worker failure" whose text never says so, so the disk itself is asked too."""
    chain: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(f"{type(x).__name__}: {x}" for x in chain)
    codes = {getattr(x, "errno", None) for x in chain}
    free = shutil.disk_usage(where).free
    if errno.ENOSPC in codes or "No space left" in text or free < need // 20:
        return f"the disk is full ({where} has {_gib(free)} free)"
    if errno.EACCES in codes or errno.EROFS in codes or any(isinstance(x, PermissionError) for x in chain):
        return f"permission denied writing under {where}"
    if "inline_container" in text or "file write failed" in text:
        return f"a file could not be written under {where} ({_gib(free)} free; the disk may be full)"
    if "Worker failure" in text or "died" in text or "killed" in text.lower():
        return "a checkpoint writer process failed: " + _first_line(err)
    return _first_line(err)


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def load(root: Path, *, module, optimizer, scheduler, on_cuda: bool) -> tuple[int, dict]:
    """Restore the latest complete iteration under `root`; returns (iteration, extra)."""
    from megatron.core import dist_checkpointing

    it_dir = layout.latest_iteration_dir(Path(root))
    if not (it_dir / STATE_FILE).is_file():
        raise UserError(
            f"{it_dir} holds no training state ({STATE_FILE}): it is a weights-only checkpoint; "
            "start training from it by passing it as the model, not to Trainer.load"
        )
    summary = json.loads((it_dir / STATE_FILE).read_text())
    init_optimizer_state(optimizer)  # Megatron loads into existing state tensors
    request = _state(module, optimizer, scheduler, is_loading=True, rng_state=None)
    same_world = summary["world_size"] == dist.get_world_size()
    if not same_world:  # per-rank RNG streams cannot be mapped onto another world size
        request.pop("rng")
    with torch.no_grad():
        loaded = dist_checkpointing.load(request, str(it_dir))
        module.load_state_dict(loaded["model"], strict=True)
        optimizer.load_state_dict(loaded["optimizer"])
    set_adam_steps(optimizer, loaded["adam_steps"])
    scheduler.num_steps = 0  # Megatron's load_state_dict advances by the saved count from here
    scheduler.load_state_dict(loaded["scheduler"])
    if same_world:
        rng.restore(loaded["rng"], on_cuda)
    return int(loaded["iteration"]), dict(loaded["extra"])
