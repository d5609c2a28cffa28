"""The decode attention kernel under Triton launch options, on CUDA: the same bits, and µs a call.

    python bench/kernel_options.py --fp8                  # the default sets below, fp8 K/V
    python bench/kernel_options.py --options "num_stages=2" "maxnreg=128 num_stages=2"

Times kernels/decode_attention.write_kv_and_attend at bench/cascade.py's decode step, which takes
that bench's options (by default 256 rows in 32 groups of 8, 256 positions past prompts of 100
and 1,000 tokens, 20 calls replayed from a CUDA graph), with the decode kernel launched as the
engine launches it and then under each set of options, cascade off and on. Each option set's
outputs are compared bit for bit with the engine's launch. A set replaces the engine's own
launch options of the same name (kernels/decode_attention.py `launch_options`: the fp8 kernel's
register cap); `maxnreg=255` is the compiler's own choice. The options are ones that leave the
kernel's arithmetic alone: `num_stages` (how many tiles the loop's loads run ahead) and `maxnreg`
(the registers a thread may use, so how many programs share a multiprocessor). `num_warps` is not
one of them: it sets the summation order (kernels/decode_attention.py). A set that is faster and
keeps the bits is a candidate for the kernel's launch. Not part of the test run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from cascade import setup, step_options  # noqa: E402
from gemv import graph_time  # noqa: E402

DEFAULT_SETS = [
    "maxnreg=255",
    "num_stages=2",
    "num_stages=4",
    "num_stages=1",
    "maxnreg=128",
    "maxnreg=128 num_stages=2",
    "maxnreg=112",
    "maxnreg=96 num_stages=2",
]


class _Launched:
    """The decode kernel launched with extra options (kernel[grid](...) as the module calls it)."""

    def __init__(self, kernel, options: dict[str, int]):
        self.kernel, self.options = kernel, options

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **{**kwargs, **self.options})


def parse(spec: str) -> dict[str, int]:
    options = dict(part.split("=", 1) for part in spec.split())
    unknown = set(options) - {"num_stages", "maxnreg"}
    if unknown:
        raise SystemExit(f"kernel_options: {sorted(unknown)} may change the bits; only num_stages and maxnreg")
    return {k: int(v) for k, v in options.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[step_options()])
    ap.add_argument("--options", nargs="+", default=DEFAULT_SETS, help='option sets, e.g. "maxnreg=128 num_stages=2"')
    args = ap.parse_args()
    sets = [("engine's launch", {})] + [(spec, parse(spec)) for spec in args.options]
    if not torch.cuda.is_available():
        print("bench/kernel_options.py needs a CUDA GPU: skipped", file=sys.stderr)
        return
    from ouro_cli.kernels import decode_attention as kernels

    engine_kernel = kernels._decode_attention_kernel
    failed = False
    for prompt in args.prompts:
        call, cascade, rows, length, _ = setup(prompt, args)
        print(f"prompt {prompt}, position {length - 1}, {rows} rows, {'fp8' if args.fp8 else 'bf16'} write+attend")
        reference = None
        for name, options in sets:
            kernels._decode_attention_kernel = _Launched(engine_kernel, options) if options else engine_kernel
            try:
                outs = (call(None), call(cascade))
                us = [graph_time(lambda i, c=c, f=call: f(c), args.reps) * 1e6 for c in (None, cascade)]
            except Exception as error:  # noqa: BLE001 (a set the compiler refuses is reported, the rest still run)
                print(f"  {name:28s} failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
                failed = True
                continue
            finally:
                kernels._decode_attention_kernel = engine_kernel
            reference = reference or outs
            same = all(torch.equal(a, b) for a, b in zip(outs, reference, strict=True))
            failed |= not same
            print(
                f"  {name:28s} cascade off {us[0]:7.1f} µs, on {us[1]:7.1f} µs  "
                f"{'same bits' if same else 'BITS DIFFER'}",
                flush=True,
            )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
