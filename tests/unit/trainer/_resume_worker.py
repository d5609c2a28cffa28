"""Subprocess worker for test_checkpoint_resume.py (one process per phase, Megatron is slow to import).

    python _resume_worker.py first  OUT   # continuous N-step runs; M-step runs that save; a save killed before commit
    python _resume_worker.py resume OUT   # fresh process: load, continue to N; load the checkpoint whose next save was
    killed

Each update's samples are drawn from the global Python / NumPy / torch RNGs (as a data
loader would), so a resume is bitwise equal only if the RNG states come back too.
Top-level imports stay light: Megatron's checkpoint saver re-imports this module.
"""

import os
import signal
import sys
from pathlib import Path

N_STEPS, SAVE_AT = 4, 2
VARIANTS = {
    "fp32": {},
    "distopt": {"use_distributed_optimizer": True},
    "bf16": {"params_dtype": "bf16"},
}  # bf16 params, fp32 main weights in the optimizer


def config(**overrides):
    from ouro_cli.trainer import TrainerConfig

    base = dict(
        device="cpu",
        lr=3e-3,
        min_lr=3e-4,
        lr_schedule="cosine",
        warmup_steps=1,
        decay_steps=6,
        weight_decay=0.01,
        clip_grad=0.5,
        micro_batch_size=3,
        pack_length=16,
        keep_last=1,
        seed=7,
    )
    return TrainerConfig(**(base | overrides))


def batch(trainer, step):
    import random

    import numpy as np
    import torch
    from _trainer_samples import make_samples

    seed = random.randrange(1 << 30) ^ int(np.random.randint(1 << 30)) ^ int(torch.randint(1 << 30, ()))
    return make_samples(trainer.model, 5, seed=seed + step)


def dump(trainer, path):
    import random

    import numpy as np
    import torch

    from ouro_cli.mcore.cpu_compat import fake_cuda_rng
    from ouro_cli.trainer.optimizer import torch_optimizers

    state = {f"param/{k}": v.clone() for k, v in trainer.module.state_dict().items()}
    for i, opt in enumerate(torch_optimizers(trainer.optimizer)):
        for g, group in enumerate(opt.param_groups):
            for j, p in enumerate(group["params"]):
                state[f"main/{i}.{g}.{j}"] = p.detach().clone()
                for key, value in opt.state[p].items():
                    state[f"adam/{i}.{g}.{j}.{key}"] = value.clone()
            state[f"lr/{i}.{g}"] = torch.tensor(group["lr"], dtype=torch.float64)
    state["scheduler"] = trainer.scheduler.state_dict()
    state["rng/torch"] = torch.get_rng_state()
    state["rng/cuda"] = fake_cuda_rng().get_state()
    state["rng/python"] = torch.tensor(random.getstate()[1])
    state["rng/numpy"] = torch.from_numpy(np.random.get_state()[1].astype(np.int64))
    torch.save(state, path)


def first(out: Path):
    from ouro_cli.model import build, tiny_config
    from ouro_cli.trainer import Trainer

    for name, options in VARIANTS.items():
        with Trainer(build(tiny_config(), seed=5), config(**options)) as trainer:
            for step in range(N_STEPS):
                trainer.train_step(batch(trainer, step))
            dump(trainer, out / f"{name}_continuous.pt")
        with Trainer(build(tiny_config(), seed=5), config(**options)) as trainer:
            for step in range(SAVE_AT):
                trainer.train_step(batch(trainer, step))
                trainer.save(out / name, iteration=step + 1, extra={"next_step": step + 1, "note": name})

    # A save killed after its data is written but before the commit: iteration 1 must stay latest.
    with Trainer(build(tiny_config(), seed=5), config(keep_last=None)) as trainer:
        trainer.train_step(batch(trainer, 0))
        trainer.save(out / "fault", iteration=1, extra={"next_step": 1})
        dump(trainer, out / "fault_iter1.pt")
        trainer.train_step(batch(trainer, 1))
        (out / "about_to_kill").touch()
        trainer.save(
            out / "fault",
            iteration=2,
            extra={"next_step": 2},
            before_commit=lambda staging: os.kill(os.getpid(), signal.SIGKILL),
        )
    raise SystemExit("unreachable: the save above kills this process")


def resume(out: Path):
    import json

    import torch
    from megatron.core import dist_checkpointing

    from ouro_cli.checkpoint import layout
    from ouro_cli.model import build, load, tiny_config
    from ouro_cli.trainer import Trainer

    model_reads_back = {}
    for name, options in VARIANTS.items():
        with Trainer(build(tiny_config(), seed=99), config(**options)) as trainer:  # other weights: load must overwrite
            extra = trainer.load(out / name)
            assert extra == {"next_step": SAVE_AT, "note": name}, extra
            assert trainer.steps_taken == SAVE_AT
            # ouro_cli.checkpoint reads the model out of a trainer checkpoint, unchanged.
            read = load(out / name).state_dict()
            live = trainer.module.state_dict()
            model_reads_back[name] = read.keys() == live.keys() and all(torch.equal(read[k], live[k]) for k in live)
            for step in range(extra["next_step"], N_STEPS):
                trainer.train_step(batch(trainer, step))
            dump(trainer, out / f"{name}_resumed.pt")
    with Trainer(build(tiny_config(), seed=99), config(keep_last=None)) as trainer:
        extra = trainer.load(out / "fault")
        dump(trainer, out / "fault_loaded.pt")
        keys = sorted(dist_checkpointing.load_tensors_metadata(str(layout.latest_iteration_dir(out / "fp32"))))
        names = sorted(trainer.module.state_dict())
    (out / "resume.json").write_text(
        json.dumps(
            {"fault_extra": extra, "checkpoint_keys": keys, "model_names": names, "model_reads_back": model_reads_back}
        )
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    {"first": first, "resume": resume}[sys.argv[1]](Path(sys.argv[2]))
