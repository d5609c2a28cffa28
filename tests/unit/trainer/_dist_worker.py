"""Subprocess worker for test_distributed.py.

    torchrun --nproc-per-node 2 _dist_worker.py OUT   # each rank trains on its share of every global batch
    python _dist_worker.py OUT                       # one process, the whole global batch

Runs N steps with the plain and then the distributed optimizer (one process group for
both) and rank 0 writes the final parameters to OUT/{plain,distopt}_world{W}.pt.
"""

import os
import sys
from pathlib import Path

N_STEPS, GLOBAL_BATCH = 3, 6


def main(out: Path):
    import torch
    import torch.distributed as dist
    from _trainer_samples import make_samples

    from ouro_cli.model import build, tiny_config
    from ouro_cli.trainer import Trainer, TrainerConfig

    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")  # shared by both trainers below
    reference = build(tiny_config(), seed=21)
    for name, distributed_optimizer in (("plain", False), ("distopt", True)):
        config = TrainerConfig(
            device="cpu",
            lr=2e-3,
            adam_eps=1e-6,
            clip_grad=0.3,
            micro_batch_size=2,
            pack_length=14,
            weight_decay=0.01,
            use_distributed_optimizer=distributed_optimizer,
        )
        trainer = Trainer(build(tiny_config(), seed=21), config)
        rank, world = trainer.context.rank, trainer.context.world_size
        metrics = []
        for step in range(N_STEPS):
            # The global batch is fixed by the step (built from the initial model), ranks take
            # contiguous shares of it.
            batch = make_samples(reference, GLOBAL_BATCH, seed=100 + step)
            share = GLOBAL_BATCH // world
            metrics.append(trainer.train_step(batch[rank * share : (rank + 1) * share]))
        if rank == 0:
            params = {k: v.clone() for k, v in trainer.module.state_dict().items()}
            torch.save({"params": params, "metrics": metrics}, out / f"{name}_world{world}.pt")
        trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(Path(sys.argv[1]))
