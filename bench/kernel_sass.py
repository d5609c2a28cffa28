"""The decode attention kernel's machine code, compiled for a GPU architecture without a GPU.

    python bench/kernel_sass.py                 # sm90 (H100 / H200): bf16 and the fp8 variants
    python bench/kernel_sass.py --write --top 30
    python bench/kernel_sass.py --write --block 32 64 128 --warps 4 8 --variants bf16 fp8

Compiles kernels/decode_attention.py's `_decode_attention_kernel` with Triton for the target
(ptxas and the disassembler ship with Triton's NVIDIA backend), for the engine's decode shape
(Ouro's 16 heads of 128 per KV head group of one, the default tile and warps unless --block and
--warps name others) and each K/V
variant: bf16 rows, packed fp8 rows with the scales outside the dots (the default mode), and
packed fp8 rows dequantized as loaded (exact mode). For each: registers, shared memory, the
SASS instruction count and the most frequent opcodes, and the memory instructions by width.
A kernel whose tile loop issues many more instructions than the bf16 one, or byte-wise shared
loads (`LDS.U8`), is bound by instructions rather than by the bytes it reads. Static counts:
no timing; the GPU benches time the kernels. Not part of the test run.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, said aloud

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from ouro_cli.kernels import decode_attention as kernels  # noqa: E402
from ouro_cli.model import kv_quant  # noqa: E402

HEAD_DIM = 128
# the kernel's PACKED (decode_attention._packed_mode)
VARIANTS = {"bf16": 0, "fp8": 2, "fp8 exact": 1}
# the kernel's pointer arguments and their element types; "kv" is the cache's (bf16 or uint8 rows)
POINTERS = {
    "Q": "bf16",
    "K": "kv",
    "V": "kv",
    "SLOTS": "i32",
    "LENGTHS": "i32",
    "OUT": "bf16",
    "K_PREV": "kv",
    "V_PREV": "kv",
    "K_NEW": "bf16",
    "V_NEW": "bf16",
    "NEW_SLOTS": "i64",
    "ACTIVE": "i1",
    "START": "i32",
    "STATE": "fp32",
    "FIRST": "i32",
    "COUNT": "i32",
}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_kernel(packed: int, write: bool, arch: int, block: int = kernels.BLOCK, warps: int = kernels.NUM_WARPS):
    """The decode kernel compiled for sm`arch` at the engine's decode shape, tiles of `block`
    positions, `warps` warps a program."""
    fn = kernels._decode_attention_kernel
    names = list(fn.arg_names)
    constants = {
        "G": 1,
        "GP": kernels.group_rows(1),
        "D": HEAD_DIM,
        "BLOCK_D": HEAD_DIM,
        "BLOCK": block,
        "IEEE": False,
        "WRITE": write,
        "HAS_PREV": write,
        "BLOCKED": False,
        "CASCADE": False,
        "DOT_AS_SUM": False,
        "PACKED": packed,
        "ROW": kv_quant.row_bytes(HEAD_DIM, 1, fp8=True) if packed else HEAD_DIM,
    }
    kv = "u8" if packed else "bf16"
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
        elif name in POINTERS:
            signature[name] = "*" + (kv if POINTERS[name] == "kv" else POINTERS[name])
            attrs[(i,)] = [["tt.divisibility", 16]]  # as Triton specializes aligned tensors at launch
        elif name == "scale":
            signature[name] = "fp32"
        else:  # strides and counts; strides of 16-byte aligned rows are multiples of 16
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = set(constants) - set(names)
    if missing:
        raise SystemExit(f"the kernel no longer takes {sorted(missing)}: update bench/kernel_sass.py")
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps, **kernels.launch_options(packed, cuda=True)},
    )


def tool(name: str, *args: str, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(BIN / name), *args, f.name], capture_output=True, text=True, check=True).stdout


OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def report(label: str, compiled, top: int) -> None:
    cubin = compiled.asm["cubin"]
    sass = tool("nvdisasm", "-c", cubin=cubin)
    usage = tool("cuobjdump", "--dump-resource-usage", cubin=cubin)
    full = OPCODE.findall(sass)
    ops = collections.Counter(op.split(".")[0] for op in full)
    memory = collections.Counter(op for op in full if op.startswith(("LD", "ST")))
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    print(
        f"{label}: {sum(ops.values())} instructions, {regs.group(1) if regs else '?'} registers, "
        f"stack {stack.group(1) if stack else '?'} B, shared {compiled.metadata.shared} B"
    )
    print("  opcodes: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(top)))
    print("  memory:  " + ", ".join(f"{op} {n}" for op, n in memory.most_common()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: H100, H200)")
    ap.add_argument("--write", action="store_true", help="the kernel with the step's fused KV write")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--top", type=int, default=16, help="opcodes listed per variant")
    ap.add_argument("--block", type=int, nargs="+", default=[kernels.BLOCK], help="positions a tile")
    ap.add_argument("--warps", type=int, nargs="+", default=[kernels.NUM_WARPS], help="warps a program")
    args = ap.parse_args()
    print(
        f"decode attention kernel, sm{args.arch}, head_dim {HEAD_DIM}, one query head per KV head"
        f"{', fused write' if args.write else ''} (the engine's tile: BLOCK {kernels.BLOCK}, "
        f"{kernels.NUM_WARPS} warps)"
    )
    for block, warps in itertools.product(args.block, args.warps):
        for label in args.variants:
            compiled = compile_kernel(VARIANTS[label], args.write, args.arch, block, warps)
            report(f"{label}, BLOCK {block}, {warps} warps", compiled, args.top)


if __name__ == "__main__":
    main()
