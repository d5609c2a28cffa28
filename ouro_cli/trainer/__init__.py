"""The Megatron-core GRPO trainer: parallel state, DDP, optimizer, GRPO loss, checkpoints.

    from ouro_cli.trainer import Sample, Trainer, TrainerConfig

`Trainer` (trainer.py) is the API; config.py holds every option; setup.py the process
group; megatron_model.py the Megatron module under HF names; batching.py, loss.py and
step.py one GRPO step; checkpointing.py and rng.py the saved training state.
Importing this package imports neither Megatron (the Trainer does, on first use) nor torch.
"""

from .config import TrainerConfig


def __getattr__(name):
    if name == "Trainer":  # lazy: importing megatron.core costs seconds
        from ouro_cli.mcore.importing import import_megatron_core

        import_megatron_core()  # the first megatron import, with its import-time compilation deferred
        from .trainer import Trainer

        return Trainer
    if name == "Sample":  # lazy too: `ouro --help` reads TrainerConfig without importing torch
        from .batching import Sample

        return Sample
    raise AttributeError(name)


__all__ = ["Sample", "Trainer", "TrainerConfig"]
