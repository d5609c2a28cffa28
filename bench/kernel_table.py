"""Summaries of a torch.profiler trace's CUDA kernels, shared by the profiling benchmarks."""

from __future__ import annotations

from collections import defaultdict

import torch

# Name fragments that sort a kernel into a family (first match wins); the rest is "other".
FAMILIES = (
    ("triton (compiled pointwise)", ("triton_",)),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "splitk", "_small_m_linear")),
    ("attention", ("flash", "fmha", "attention", "cudnn", "_attn", "_decode_attention")),
    ("optimizer", ("adam", "multi_tensor", "l2norm", "foreach")),
    ("communication", ("nccl",)),
    ("copy / fill", ("memcpy", "memset", "copy_", "fill", "cat")),
    ("torch elementwise / reduce", ("elementwise", "reduce", "vectorized", "unrolled")),
)


def cuda_kernels(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(key in low for key in keys)), "other")


def print_kernel_table(kernels: list, top: int, indent: str = "  ") -> float:
    """Print GPU-busy time per family and the `top` kernels by total GPU time; returns busy µs."""
    busy_us = sum(e.device_time for e in kernels)
    by_family: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_family[family(e.name)] += e.device_time
        by_name[e.name[:70]].append(e.device_time)
    print(
        f"{indent}by family: "
        + ", ".join(f"{fam} {us / 1e3:.2f} ms" for fam, us in sorted(by_family.items(), key=lambda kv: -kv[1]))
    )
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{indent}  {sum(times) / 1e3:8.3f} ms  {len(times):5d} x {sum(times) / len(times):8.1f} µs  {name}")
    return busy_us
