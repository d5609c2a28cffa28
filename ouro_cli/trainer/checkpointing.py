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

Validity (ouro_cli.checkpoint.layout): everything is written under `iter_N.staging/`,
then the staging directory is marked complete, renamed and the tracker rewritten, all
by rank 0 after every rank finished writing. A process killed at any point before the
tracker moves leaves the previous iteration as latest; older iterations are pruned
only after that (keep_last). Megatron's saver spawns a helper process that re-imports
`__main__`: a script that saves needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ouro_cli.checkpoint import layout
from ouro_cli.errors import UserError

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


def save(root: Path, iteration: int, *, module, optimizer, scheduler, on_cuda: bool, extra: dict | None,
         keep_last: int | None, before_commit: Callable[[Path], None] | None = None) -> Path:
    """Write iteration `iteration` under `root` and make it the latest (collective call)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    extra = dict(extra or {})
    try:
        extra_json = json.dumps(extra, sort_keys=True)
    except TypeError as err:
        raise UserError(f"checkpoint extra state must be JSON-serialisable: {err}") from err
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
    init_optimizer_state(optimizer)  # the distributed optimizer cannot save a state that does not exist
    state = _state(module, optimizer, scheduler, is_loading=False, iteration=iteration,
                   extra=extra, rng_state=rng.capture(on_cuda))
    dist_checkpointing.save(state, str(staging), content_metadata=CONTENT_METADATA)
    dist.barrier()
    if rank0:
        summary = {"iteration": iteration, "world_size": dist.get_world_size(), "scheduler": scheduler.state_dict(),
                   "adam_steps": state["adam_steps"], "extra": json.loads(extra_json)}
        (staging / STATE_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        if before_commit is not None:
            before_commit(staging)
        layout.commit_iteration(root, iteration, keep_last=keep_last)
    dist.barrier()
    return root / layout.iteration_dir_name(iteration)


def load(root: Path, *, module, optimizer, scheduler, on_cuda: bool) -> tuple[int, dict]:
    """Restore the latest complete iteration under `root`; returns (iteration, extra)."""
    from megatron.core import dist_checkpointing

    it_dir = layout.latest_iteration_dir(Path(root))
    if not (it_dir / STATE_FILE).is_file():
        raise UserError(f"{it_dir} holds no training state ({STATE_FILE}): it is a weights-only checkpoint; "
                        "start training from it by passing it as the model, not to Trainer.load")
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
