"""What every Megatron-core user in ouro needs: process groups and the CPU compatibility layer.

checkpoint/ (dist checkpoints) and trainer/ (DDP, optimizer) both run Megatron code;
the one place that makes that code run on a CPU-only process lives here.
"""

from .cpu_compat import megatron_on_cpu
from .process import single_process_group

__all__ = ["megatron_on_cpu", "single_process_group"]
