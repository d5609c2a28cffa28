"""Benchmark `ouro convert` at Ouro-1.4B shapes: wall time and peak memory of each direction.

    python bench/convert.py [--workdir DIR] [--keep]

Builds a random bf16 checkpoint with the real 1.4B names and shapes (269 tensors,
2.87 GB) as one `model.safetensors`, written tensor by tensor so this script never
holds the model, then runs `ouro convert hf-to-mcore` and `ouro convert mcore-to-hf` in
subprocesses. Memory is sampled while each runs:

- peak RSS of the command's own process (kernel high-water mark, VmHWM);
- peak PSS summed over its process tree (megatron forks writer processes that share
  the parent's pages copy-on-write: PSS counts each shared page once, RSS would not);
- the anonymous part of that PSS: safetensors memory-maps the files it reads, so their
  pages show up in RSS and PSS while being page cache the kernel can drop; anonymous
  memory is what a conversion really holds.

The goal is at most about one model copy: the ratios to the model's byte size are
printed. Not a test; bench/ is outside pytest's testpaths.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ouro_cli.checkpoint import expected_shapes  # noqa: E402
from ouro_cli.model import OuroConfig  # noqa: E402

REMOTE_CODE_CONFIG = {
    "architectures": ["OuroForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_ouro.OuroConfig",
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
    },
    "torch_dtype": "bfloat16",
}


def write_random_hf(path: Path, seed: int = 0, layers: int = 24) -> int:
    """One bf16 model.safetensors at Ouro-1.4B shapes (`layers` 48: Ouro-2.6B's), streamed;
    returns the weight bytes.

    The safetensors layout is written by hand (8-byte header length, JSON header with
    data offsets, then the raw tensors in order) so that only one tensor is in memory.
    """
    config = OuroConfig(num_hidden_layers=layers, extra=dict(REMOTE_CODE_CONFIG))
    shapes = expected_shapes(config)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    generator = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True)
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for name, shape in shapes.items():
            tensor = torch.empty(shape, dtype=torch.bfloat16)
            if "norm" in name:
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
            f.write(memoryview(tensor.view(torch.uint8).numpy()))
    config.save(path)
    (path / "modeling_ouro.py").write_text("# remote code stand-in\n")
    (path / "configuration_ouro.py").write_text("# remote code stand-in\n")
    (path / "tokenizer.json").write_text('{"version": "1.0"}\n')
    (path / "tokenizer_config.json").write_text("{}\n")
    return offset


class MemorySampler:
    """Polls a process tree: the root's VmHWM, and PSS summed over all its processes —
    in total and the anonymous part alone (memory-mapped files count as page cache)."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak_hwm = self.peak_tree_pss = self.peak_tree_pss_anon = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and self.root.is_running():
            try:
                self.peak_hwm = max(self.peak_hwm, _proc_fields(self.root.pid, "status")["VmHWM"])
                pss = pss_anon = 0
                for proc in [self.root, *self.root.children(recursive=True)]:
                    with contextlib.suppress(OSError, KeyError):
                        rollup = _proc_fields(proc.pid, "smaps_rollup")
                        pss, pss_anon = pss + rollup["Pss"], pss_anon + rollup["Pss_Anon"]
                self.peak_tree_pss = max(self.peak_tree_pss, pss)
                self.peak_tree_pss_anon = max(self.peak_tree_pss_anon, pss_anon)
                self.samples += 1
            except (psutil.Error, OSError, KeyError):
                pass  # the process is exiting
            time.sleep(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _proc_fields(pid: int, name: str) -> dict[str, int]:
    """The `Key: N kB` lines of /proc/PID/NAME, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/{name}") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


def run_measured(args: list[str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ouro_cli.cli.app", *args, "--json"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sampler = MemorySampler(proc.pid)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"ouro {' '.join(args)} failed ({proc.returncode}):\n{stderr}")
    return {
        "wall_s": wall,
        "peak_rss": sampler.peak_hwm,
        "peak_tree_pss": sampler.peak_tree_pss,
        "peak_tree_pss_anon": sampler.peak_tree_pss_anon,
        "samples": sampler.samples,
        "result": json.loads(stdout),
    }


def same_tensors(a: Path, b: Path) -> bool:
    """Compare two safetensors files tensor by tensor (their headers may order keys differently)."""
    from safetensors import safe_open

    with safe_open(a, framework="pt") as fa, safe_open(b, framework="pt") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()):
            return False
        for key in fa.keys():
            x, y = fa.get_tensor(key), fb.get_tensor(key)
            if x.dtype != y.dtype or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="where to build (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    options = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ouro-bench-convert-", dir=options.workdir))
    try:
        t0 = time.perf_counter()
        model_bytes = write_random_hf(work / "hf")
        print(
            f"random Ouro-1.4B checkpoint: {model_bytes / 1e9:.2f} GB bf16 in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        runs = {
            "hf-to-mcore": run_measured(["convert", "hf-to-mcore", str(work / "hf"), str(work / "mcore")]),
            "mcore-to-hf": run_measured(["convert", "mcore-to-hf", str(work / "mcore"), str(work / "hf_back")]),
        }
        same = same_tensors(work / "hf" / "model.safetensors", work / "hf_back" / "model.safetensors")
        print(f"model: {model_bytes / 1e9:.3f} GB; HF -> Megatron -> HF bit-exact: {same}")
        columns = [("peak RSS", "peak_rss"), ("tree PSS", "peak_tree_pss"), ("tree PSS anon", "peak_tree_pss_anon")]
        print(
            f"{'command':<13}{'wall s':>8}{'cmd s':>7}" + "".join(f"{c + ' GB':>17}{'x model':>9}" for c, _ in columns)
        )
        for name, run in runs.items():
            print(
                f"{name:<13}{run['wall_s']:>8.1f}{run['result']['seconds']:>7.1f}"
                + "".join(f"{run[k] / 1e9:>17.2f}{run[k] / model_bytes:>9.2f}" for _, k in columns)
            )
        print(
            "(cmd s: the command's own timing, after imports and validation; it includes hashing the inputs "
            "for manifest.json. PSS anon excludes memory-mapped checkpoint files, which are page cache.)"
        )
    finally:
        if options.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
