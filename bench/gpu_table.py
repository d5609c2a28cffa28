"""The GPU table: decode, publication, training and engine-vs-trainer agreement, each
against its roofline, the HF anchor and our target, in one run of under 9 minutes.

    python bench/gpu_table.py --device cuda --json OUT.json      # H200: Ouro-1.4B shape, random bf16 weights
    python bench/gpu_table.py --device cpu --quick               # CPU smoke run: tiny shape, fp32
    python bench/gpu_table.py --device cuda --sections decode,publish

Sections (`--sections`, in this order; each guarded: an error is printed and recorded,
the next section still runs; the JSON is rewritten after every row, so a run cut short
still leaves its finished rows):

- decode: tok/s of `LLM.generate` for K ∈ {2, 3, 4} × batch ∈ {1, 16, 64, 128}, 128-token
  prompts and 128 new tokens (the anchor's shape). One engine whose KV cache holds the
  largest batch; per row bench/decode.py's `measure`: a full-length warm-up run (captures
  the CUDA graphs of that batch bucket, K and every context width), then decode time = a
  129-token run minus the time it spent in prefill (which samples the first token).
  Roofline: bench/decode.py's bytes per step at the mean context (prompt + new/2).
- publish: the RL loop's path, `rl.publish.publish(engine, trainer.named_weights_for_
  publication(), version)`, into a live engine built as the loop builds it (default
  max_num_seqs 32 and KV size, `--publish-kv-*`), trainer and engine on one device, in
  place; afterwards the engine's weights must equal the trainer's and no parameter may have
  moved. Also timed apart: the weights alone (buckets between start and finish, so without
  `start_weight_update`'s KV invalidation), that invalidation itself (it frees the blocks and
  writes nothing), the
  fused copy publication now uses (`publication.copy_into`) and the per-tensor `copy_` loop
  it replaced, over the same tensors, and the copy limit: one flat torch copy of the same
  bytes (the "anchor" of these rows). Roofline: read + write of the bytes at `--bandwidth`.
- train: `Trainer.train_step` tok/s and model TFLOP/s at 8 × 1024 (256 + 768), K = T, bf16,
  recompute off, micro-batch 4 (bench/train_step.py's FLOP accounting). The HF anchor
  (7,041 tok/s, 221 TFLOP/s) is forward + backward with recompute; ours is a whole step.
- agree: rollouts of the engine (K = 2, 3, 4 and τ = 0.7 threshold exits) replayed by the
  trainer on the same weights (published by the loop's path): mean and max |Δ logprob|,
  bf16 and fp32.

Ratios are oriented so that higher is better: measured/reference for rates, reference/
measured for times and errors. "roofline" is the fraction of the roofline reached;
"anchor" > 1 beats the HF remote-code anchor (publication: the measured copy limit);
"target" >= 1 meets the target. Random weights at the real shape; no downloads.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # run from a checkout without installing; sibling benches

import decode as decode_bench  # noqa: E402
import torch  # noqa: E402
import train_step as train_bench  # noqa: E402

from ouro_cli.engine import LLM  # noqa: E402
from ouro_cli.model import OuroConfig, from_state_dict, tiny_config  # noqa: E402

# Public reference and our targets (docs/performance.md#how-to-read-it). Anchor: HF remote code on the
# H200, Ouro-1.4B, K = 4, bf16, SDPA, 128-token prompts and 128 new tokens.
HF_DECODE_K4 = {1: 7.6, 16: 123.0, 64: 397.0}
TARGET_DECODE_K4 = {1: 170.0, 16: 2500.0, 64: 7000.0}
HF_TRAIN_TOK_S, HF_TRAIN_TFLOPS, TARGET_TRAIN_TFLOPS = 7041.0, 221.0, 350.0
TARGET_PUBLISH_MS = 3.0
TARGET_AGREE = {"bf16": 1e-2, "fp32": 1e-5}
SECTIONS = ("decode", "publish", "train", "agree")


@dataclass
class Row:
    what: str
    shape: str
    measured: float | None
    unit: str
    roofline: float | None = None
    anchor: float | None = None
    target: float | None = None
    higher_is_better: bool = True
    note: str = ""
    extra: dict = field(default_factory=dict)

    def ratio(self, ref: float | None) -> float | None:
        m = self.measured
        if ref is None or m is None or not math.isfinite(m) or ref == 0:
            return None
        if self.higher_is_better:
            return m / ref
        return ref / m if m > 0 else math.inf

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "ratio_roofline": self.ratio(self.roofline),
            "ratio_anchor": self.ratio(self.anchor),
            "ratio_target": self.ratio(self.target),
        }


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    a = abs(x)
    if a >= 1e4:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    if a >= 1e-3:
        return f"{x:.4f}"
    return f"{x:.2e}"


def size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}" if math.isfinite(x) else "inf"


class Bench:
    """Options, the shared trainer (one at a time: Megatron's parallel state is global), the
    rows so far, per-section timings and errors; writes the JSON after every change."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = args.device
        self.cuda = args.device.startswith("cuda")
        self.dtype_name = args.dtype  # of decode, publish and train
        self.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        self.rows: list[Row] = []
        self.sections: dict[str, dict] = {}
        self.details: dict[str, dict] = {}
        self.started = time.perf_counter()
        self.meta = meta(args)
        self._trainer = None
        self._trainer_key: tuple | None = None

    # ---- shapes and timing ------------------------------------------------------------
    @staticmethod
    def config(shape: str) -> OuroConfig:
        return OuroConfig() if shape == "1.4b" else tiny_config()  # OuroConfig defaults are Ouro-1.4B

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def random_model(self, shape: str, dtype: torch.dtype):
        torch.manual_seed(0)
        return decode_bench.random_model(self.config(shape), dtype, self.device)

    # ---- the shared trainer -----------------------------------------------------------
    def trainer(self, shape: str, dtype: str):
        """A Trainer on a random model of `shape` in `dtype` ("bf16" | "fp32"): recompute off,
        micro-batch 4, the configuration bench/train_step.py measured fastest at 8 × 1024."""
        key = (shape, dtype)
        if self._trainer_key != key:
            self.drop_trainer()
            torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
            t0 = time.perf_counter()
            trainer, _ = train_bench.build_trainer(
                shape,
                "cuda" if self.cuda else "cpu",
                dtype,
                micro_batch_size=self.args.micro_batch_size,
                recompute=False,
                model=self.random_model(shape, torch_dtype),
            )
            print(f"  trainer {shape} {dtype} built in {time.perf_counter() - t0:.1f} s", flush=True)
            self._trainer, self._trainer_key = trainer, key
        return self._trainer

    def drop_trainer(self) -> None:
        if self._trainer is not None:
            trainer, self._trainer, self._trainer_key = self._trainer, None, None
            trainer.close()
            del trainer
        self.free()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    # ---- results ----------------------------------------------------------------------
    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(
            f"  {row.what:<34} {row.shape:<28} {fmt(row.measured):>10} {row.unit:<7} "
            f"roof {fmt_ratio(row.ratio(row.roofline)):>6}  anchor {fmt_ratio(row.ratio(row.anchor)):>6}  "
            f"target {fmt_ratio(row.ratio(row.target)):>6}  [{self.elapsed():.0f} s]"
            + (f"  {row.note}" if row.note else ""),
            flush=True,
        )
        self.write_json()

    def over_budget(self, budget: float) -> bool:
        return self.elapsed() > budget

    def write_json(self) -> None:
        if not self.args.json:
            return
        doc = {
            "meta": self.meta,
            "elapsed_s": round(self.elapsed(), 2),
            "sections": self.sections,
            "rows": [r.as_dict() for r in self.rows],
            "details": self.details,
        }
        path = Path(self.args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str))
        os.replace(tmp, path)


def meta(args: argparse.Namespace) -> dict:
    info = {"argv": sys.argv, "options": vars(args), "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["git"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except Exception:  # noqa: BLE001 - no git on the machine is fine
        pass
    return info


# ---- decode ---------------------------------------------------------------------------


def section_decode(b: Bench) -> None:
    a = b.args
    config = b.config(a.shape)
    dtype = b.dtype
    elem = torch.finfo(dtype).bits // 8
    model = b.random_model(a.shape, dtype)
    max_batch, block = max(a.batches), a.block_size
    per_seq = -(-(a.prompt + a.new_tokens + 1) // block)  # +1 token of slack: the last sampled token
    kv_blocks = max_batch * per_seq
    llm = LLM(
        model,
        max_num_seqs=max_batch,
        kv_blocks=kv_blocks,
        block_size=block,
        max_prefill_tokens=max_batch * a.prompt,
        overlap=not a.no_overlap,
    )
    kv_gib = llm.kv.k.numel() * 2 * elem / 2**30
    print(
        f"  engine: max_num_seqs {max_batch}, {kv_blocks} KV blocks of {block} tokens ({kv_gib:.1f} GiB), "
        f"graphs {'on' if llm.runner.graphs is not None else 'off'}, overlap {'on' if llm.overlap else 'off'}",
        flush=True,
    )
    context = a.prompt + a.new_tokens / 2  # mean cached tokens over the decode steps
    try:
        for batch in a.batches:
            for k in a.loops:
                shape = f"{a.shape} b{batch} K{k} {a.prompt}+{a.new_tokens}"
                what = f"decode K={k} batch {batch}"
                anchor = HF_DECODE_K4.get(batch) if (k == 4 and a.shape == "1.4b") else None
                target = TARGET_DECODE_K4.get(batch) if (k == 4 and a.shape == "1.4b") else None
                roof = decode_bench.roofline_tokens_per_s(config, k, batch, context, elem, a.bandwidth)
                if b.over_budget(a.decode_budget_s):
                    b.add(
                        Row(
                            what,
                            shape,
                            None,
                            "tok/s",
                            roof,
                            anchor,
                            target,
                            note=f"skipped: decode budget {a.decode_budget_s:.0f} s spent",
                        )
                    )
                    continue
                try:
                    start = time.perf_counter()
                    # warm-up run (captures this batch bucket's and K's CUDA graph), then
                    # (new_tokens + 1)-token run minus its prefill time: bench/decode.py's measure
                    seconds = decode_bench.measure(llm, batch, a.prompt, a.new_tokens, k, config.vocab_size, b.device)
                    row_s = time.perf_counter() - start
                    tok_s = batch * a.new_tokens / seconds if seconds > 0 else None
                    b.add(
                        Row(
                            what,
                            shape,
                            tok_s,
                            "tok/s",
                            roof,
                            anchor,
                            target,
                            note="" if tok_s else f"noisy: decode time {seconds:.3f} s <= 0",
                            extra={"decode_s": seconds, "row_s": row_s, "roofline_tok_s": roof, "context": context},
                        )
                    )
                except Exception as err:  # noqa: BLE001 - one failed row must not end the section
                    traceback.print_exc()
                    b.add(Row(what, shape, None, "tok/s", roof, anchor, target, note=f"error: {err!r}"[:200]))
                    b.free()
    finally:
        llm.close()
        del llm, model


# ---- publication ----------------------------------------------------------------------


def section_publish(b: Bench) -> None:
    from ouro_cli.engine.publication import copy_into, physical_name
    from ouro_cli.rl.publish import DEFAULT_BUCKET_BYTES, buckets, publish

    a = b.args
    config = b.config(a.shape)
    dtype = b.dtype
    try:
        trainer = b.trainer(a.shape, b.dtype_name)
        source, src_model = "trainer", None

        def named():
            return trainer.named_weights_for_publication()
    except Exception as err:  # noqa: BLE001 - no Megatron here: publish from a plain model on the device
        traceback.print_exc()
        source, src_model = f"model (trainer unavailable: {type(err).__name__})", b.random_model(a.shape, dtype)

        def named():
            return ((n, p.detach()) for n, p in src_model.named_parameters())

    tensors = list(named())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    devices = {str(t.device) for _, t in tensors}
    engine_model = from_state_dict(config, {n: t.detach().clone() for n, t in tensors}, device=b.device)
    # The loop's engine options: --max-num-seqs (default 32) and --kv-blocks (default: the engine's own).
    kv_blocks = None if a.publish_kv_tokens is None else a.publish_kv_seqs * -(-a.publish_kv_tokens // 16)
    engine = LLM(engine_model, max_num_seqs=a.publish_kv_seqs, kv_blocks=kv_blocks)
    kv_bytes = 2 * engine.kv.k.numel() * engine.kv.k.element_size()
    ptrs = {n: p.data_ptr() for n, p in engine_model.named_parameters()}
    shape = f"{a.shape} {b.dtype_name} {nbytes / 1e9:.2f} GB, {len(tensors)} tensors"
    print(
        f"  source {source} on {sorted(devices)}, engine on {engine.device}; {len(tensors)} tensors, "
        f"{nbytes / 1e9:.3f} GB; engine KV {size(kv_bytes)} (max_num_seqs {a.publish_kv_seqs})",
        flush=True,
    )
    version = [0]

    def next_version() -> int:
        version[0] += 1
        return version[0]

    def rl_path():
        publish(engine, named(), version=next_version())

    def weights_only():
        engine.start_weight_update(next_version())
        b.sync()
        start = time.perf_counter()
        for bucket in buckets(named(), DEFAULT_BUCKET_BYTES):
            engine.update_weights(bucket)
        engine.finish_weight_update()
        b.sync()
        return time.perf_counter() - start

    params = dict(engine_model.named_parameters())
    dst = [params[physical_name(n)] for n, _ in tensors]
    src = [t for _, t in tensors]

    def median_ms(fn, repeats: int) -> tuple[float, list[float]]:
        fn()  # warm-up
        times = sorted(fn() for _ in range(repeats))
        return times[len(times) // 2] * 1e3, [round(t * 1e3, 4) for t in times]

    try:
        r = a.publish_repeats
        roof_ms = 2 * nbytes / a.bandwidth * 1e3
        flat = [torch.ones(nbytes // 2, dtype=torch.int16, device=b.device) for _ in range(2)]
        copy_ms, copy_all = median_ms(lambda: b.timed(lambda: flat[1].copy_(flat[0])), r)
        flat.clear()
        rl_ms, rl_all = median_ms(lambda: b.timed(rl_path), r)
        w_ms, w_all = median_ms(weights_only, r)
        with torch.no_grad():  # the engine starts from its own clone: scramble it so the check below means something
            for p in dst:
                p.zero_()
        rl_path()
        final = engine.get_weight_version()
        same = all(torch.equal(p, t) for p, t in zip(dst, src, strict=True))
        kept = ptrs == {n: p.data_ptr() for n, p in engine_model.named_parameters()}
        kv_ms, kv_all = median_ms(lambda: b.timed(engine.kv.invalidate), r)
        fe_ms, fe_all = median_ms(lambda: b.timed(lambda: copy_into(dst, src)), r)
        loop_ms, loop_all = median_ms(lambda: b.timed(lambda: per_tensor_copy(dst, src)), r)
        check = f"version {final}, weights {'equal' if same else 'DIFFER'}, storage {'kept' if kept else 'MOVED'}"
        print(f"  after publication: {check}", flush=True)
        b.details["publish"] = {
            "source": source,
            "tensors": len(tensors),
            "bytes": nbytes,
            "kv_bytes": kv_bytes,
            "engine_max_num_seqs": a.publish_kv_seqs,
            "times_ms": {
                "copy_limit": copy_all,
                "rl_path": rl_all,
                "weights_only": w_all,
                "kv_invalidate": kv_all,
                "fused_copy": fe_all,
                "per_tensor_copy": loop_all,
            },
            "weights_equal": same,
            "storage_kept": kept,
            "final_version": final,
        }
        note = "" if same and kept else f"CHECK FAILED: {check}"
        b.add(
            Row(
                "publish: RL path (rl.publish)",
                f"{shape}, KV {size(kv_bytes)}",
                rl_ms,
                "ms",
                roof_ms,
                copy_ms,
                TARGET_PUBLISH_MS,
                higher_is_better=False,
                note=note or f"source {source}",
            )
        )
        b.add(
            Row(
                "publish: weights only (no start)",
                shape,
                w_ms,
                "ms",
                roof_ms,
                copy_ms,
                TARGET_PUBLISH_MS,
                higher_is_better=False,
                note=note,
            )
        )
        b.add(
            Row(
                "publish: KV invalidate (free blocks)",
                f"KV {size(kv_bytes)}",
                kv_ms,
                "ms",
                None,
                None,
                None,
                higher_is_better=False,
                note="frees every block; the planes are not written",
            )
        )
        b.add(
            Row(
                "publish: fused copy alone (copy_into)",
                shape,
                fe_ms,
                "ms",
                roof_ms,
                copy_ms,
                TARGET_PUBLISH_MS,
                higher_is_better=False,
            )
        )
        b.add(
            Row(
                "publish: per-tensor copy_ loop (old)",
                shape,
                loop_ms,
                "ms",
                roof_ms,
                copy_ms,
                TARGET_PUBLISH_MS,
                higher_is_better=False,
                note="the copy before the fused one",
            )
        )
        b.add(
            Row(
                "copy limit: one flat torch copy",
                f"{nbytes / 1e9:.2f} GB",
                copy_ms,
                "ms",
                roof_ms,
                None,
                TARGET_PUBLISH_MS,
                higher_is_better=False,
                note="the anchor of the rows above",
            )
        )
    finally:
        engine.close()


@torch.no_grad()
def per_tensor_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src)


# ---- training -------------------------------------------------------------------------


def section_train(b: Bench) -> None:
    a = b.args
    trainer = b.trainer(a.shape, b.dtype_name)
    res = train_bench.measure_steps(
        trainer,
        a.shape,
        samples=a.train_samples,
        prompt_len=a.train_prompt,
        response_len=a.train_response,
        steps=a.train_steps,
        warmup=a.train_warmup,
    )
    b.details["train"] = res
    tok_s, tflops = res["tokens_per_s"], res["model_tflops_per_s"]
    anchored = a.shape == "1.4b" and a.train_samples == 8 and a.train_prompt + a.train_response == 1024
    per_token = tflops / tok_s if tok_s else math.nan  # model TFLOP per token
    shape = (
        f"{a.shape} {res['dtype']} {a.train_samples}x{a.train_prompt + a.train_response} K=T "
        f"mb{res['micro_batch_size']}{' rc' if res['recompute'] else ''}"
    )
    note = f"step {res['step_s_median']:.3f} s (fwd+bwd {res['forward_backward_s']:.3f}, opt {res['optimizer_s']:.3f})"
    if "peak_memory_gib" in res:
        note += f", peak {res['peak_memory_gib']} GiB"
    b.add(
        Row(
            "train tok/s",
            shape,
            tok_s,
            "tok/s",
            a.gemm_flops / 1e12 / per_token,
            HF_TRAIN_TOK_S if anchored else None,
            TARGET_TRAIN_TFLOPS / per_token if anchored else None,
            note=note,
        )
    )
    b.add(
        Row(
            "train model TFLOP/s",
            shape,
            tflops,
            "TFLOP/s",
            a.gemm_flops / 1e12,
            HF_TRAIN_TFLOPS if anchored else None,
            TARGET_TRAIN_TFLOPS if anchored else None,
            note=f"executed {res['executed_tflops_per_s']} TFLOP/s",
        )
    )


# ---- agreement ------------------------------------------------------------------------


def section_agree(b: Bench) -> None:
    from ouro_cli.rl.publish import publish
    from ouro_cli.trainer import Sample

    a = b.args
    shape = a.agree_shape or a.shape
    for dtype_name in a.agree_dtypes:
        what = f"agree {dtype_name}: mean |Δ logprob|"
        if b.over_budget(a.budget_s):
            b.add(
                Row(
                    what,
                    shape,
                    None,
                    "nats",
                    target=TARGET_AGREE.get(dtype_name),
                    higher_is_better=False,
                    note=f"skipped: --budget-s {a.budget_s:.0f} spent",
                )
            )
            continue
        try:
            trainer = b.trainer(shape, dtype_name)
            config = trainer.model.config
            policies = decode_bench.agree_policies(config.total_ut_steps)
            rows = [(k, tau) for k, tau in policies for _ in range(a.agree_per_policy)]
            n = len(rows)
            prompts = decode_bench.make_prompts(n, a.agree_prompt, config.vocab_size)
            weights = {name: x.detach().clone() for name, x in trainer.named_weights_for_publication()}
            engine_model = from_state_dict(config, weights, device=trainer.device)
            del weights
            engine = decode_bench.rollout_engine(engine_model, n, a.agree_prompt, a.agree_new_tokens)
            try:
                publish(engine, trainer.named_weights_for_publication(), version=1)  # the loop's path
                outs = engine.generate(prompts, decode_bench.rollout_params(rows, a.agree_new_tokens))
            finally:
                engine.close()
                del engine, engine_model
            samples = [
                Sample(
                    prompt_ids=p,
                    response_ids=list(o.output_token_ids),
                    exit_depths=list(o.exit_depths),
                    rollout_logprobs=[float(x) for x in o.log_probs],
                    advantage=0.0,
                    temperature=1.0,
                )
                for p, o in zip(prompts, outs, strict=True)
            ]
            metrics = trainer.forward_backward(samples)
            depths = [d for o in outs for d in o.exit_depths[1:]]
            mean_depth = sum(depths) / max(1, len(depths))
            label = f"{shape} {dtype_name} {n}x({a.agree_prompt}+{a.agree_new_tokens})"
            b.details[f"agree_{dtype_name}"] = {
                "shape": shape,
                "rollouts": n,
                "policies": policies,
                "mean_exit_depth": mean_depth,
                **metrics,
            }
            target = TARGET_AGREE.get(dtype_name)
            b.add(
                Row(
                    what,
                    label,
                    metrics["logprob_mismatch_mean"],
                    "nats",
                    None,
                    None,
                    target,
                    higher_is_better=False,
                    note=f"K 2/3/4 + tau 0.7; mean depth {mean_depth:.2f}; {metrics['response_tokens']} tokens",
                )
            )
            b.add(
                Row(
                    f"agree {dtype_name}: max |Δ logprob|",
                    label,
                    metrics["logprob_mismatch_max"],
                    "nats",
                    higher_is_better=False,
                )
            )
        except Exception as err:  # noqa: BLE001 - the other dtype still runs
            traceback.print_exc()
            b.add(Row(what, shape, None, "nats", note=f"error: {err!r}"[:200]))
        finally:
            b.drop_trainer()


# ---- the table and main ---------------------------------------------------------------


def table(rows: list[Row]) -> str:
    header = ["what", "shape", "measured", "unit", "target / anchor", "x roofline", "x anchor", "x target"]
    lines = []
    for r in rows:
        ref = f"{'>=' if r.higher_is_better else '<='}{fmt(r.target)}" if r.target is not None else "-"
        ref += f" / {fmt(r.anchor)}" if r.anchor is not None else " / -"
        lines.append(
            [
                r.what,
                r.shape,
                fmt(r.measured),
                r.unit,
                ref,
                fmt_ratio(r.ratio(r.roofline)),
                fmt_ratio(r.ratio(r.anchor)),
                fmt_ratio(r.ratio(r.target)),
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(header, *lines, strict=True)]
    right = {2, 5, 6, 7}

    def line(cells):
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [line(header), "  ".join("-" * w for w in widths), *(line(cells) for cells in lines)]
    notes = [f"  {r.what} [{r.shape}]: {r.note}" for r in rows if r.note]
    if notes:
        out += ["notes:", *notes]
    out.append(
        "ratios: higher is better; x roofline = fraction of the roofline reached; x anchor > 1 beats the "
        "anchor; x target >= 1 meets the target"
    )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=["tiny", "1.4b"], help="default: 1.4b on CUDA, tiny on CPU")
    ap.add_argument(
        "--dtype", choices=["bf16", "fp32"], help="decode/publish/train dtype; default bf16 on CUDA, fp32 on CPU"
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="batches 1 and 64 (tiny: 16) at K 2 and 4, fewer steps, repeats and rollouts",
    )
    ap.add_argument("--json", help="write the results here (rewritten after every row)")
    ap.add_argument("--bandwidth", type=float, default=4.26e12, help="bytes/s, the roofline (H200 copy: 4.26e12)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="sections (and agree dtypes) not yet started once the run is this old are skipped, reported",
    )
    ap.add_argument("--gemm-flops", type=float, default=780e12, help="FLOP/s, the training roofline (H200 bf16)")
    g = ap.add_argument_group("decode")
    g.add_argument("--batches", type=int, nargs="+", help="default 1 16 64 128 (--quick: 1 64; tiny: 1 16)")
    g.add_argument("--loops", "-K", type=int, nargs="+", help="default 2 3 4 (--quick: 2 4)")
    g.add_argument("--prompt", type=int, default=128)
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--no-overlap",
        action="store_true",
        help="decode one step at a time (LLM(overlap=False)): the host's per-step work between steps",
    )
    g.add_argument(
        "--decode-budget-s",
        type=float,
        help="decode rows not yet started once the run is this old are skipped, reported (default 330; tiny: 60)",
    )
    g = ap.add_argument_group("publish")
    g.add_argument("--publish-repeats", type=int, help="timed repeats per row, median (default 7, --quick 3)")
    g.add_argument("--publish-kv-seqs", type=int, default=32, help="engine max_num_seqs (the loop's default: 32)")
    g.add_argument(
        "--publish-kv-tokens",
        type=int,
        default=None,
        help="KV tokens per sequence; default: the engine's (min(max_model_len, 2048))",
    )
    g = ap.add_argument_group("train")
    g.add_argument("--train-samples", type=int, default=8)
    g.add_argument("--train-prompt", type=int, help="default 256 (1.4b) / 32 (tiny)")
    g.add_argument("--train-response", type=int, help="default 768 (1.4b) / 96 (tiny)")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--train-steps", type=int, help="timed steps, median (default 3, --quick 2)")
    g.add_argument("--train-warmup", type=int, help="default 2, --quick 1")
    g = ap.add_argument_group("agree")
    g.add_argument("--agree-shape", choices=["tiny", "1.4b"], help="default: --shape")
    g.add_argument("--agree-dtypes", nargs="+", choices=["bf16", "fp32"], default=["bf16", "fp32"])
    g.add_argument("--agree-per-policy", type=int, help="rollouts per (K, τ) policy; default 4, --quick 2")
    g.add_argument("--agree-prompt", type=int, default=64)
    g.add_argument("--agree-new-tokens", type=int, default=64)
    g.add_argument(
        "--prefill-group",
        type=int,
        help="prompts prefilled together, in every dtype (the engine's runner.MAX_PREFILL_GROUP, "
        "32, and MAX_PREFILL_GROUP_FP32, 1; 1: one prompt at a time): tells how the grouping moves "
        "the agreement",
    )
    args = ap.parse_args(argv)
    if args.prefill_group is not None:
        if args.prefill_group < 1:
            ap.error("--prefill-group takes a positive number of prompts")
        from ouro_cli.engine import runner

        runner.MAX_PREFILL_GROUP = runner.MAX_PREFILL_GROUP_FP32 = args.prefill_group

    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("1.4b" if cuda else "tiny")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    q = args.quick
    args.batches = args.batches or ([1, 64 if args.shape == "1.4b" else 16] if q else [1, 16, 64, 128])
    args.loops = args.loops or ([2, 4] if q else [2, 3, 4])
    args.publish_repeats = args.publish_repeats or (3 if q else 7)
    big = args.shape == "1.4b"
    args.decode_budget_s = args.decode_budget_s or (330.0 if big else 60.0)
    args.train_prompt = args.train_prompt or (256 if big else 32)
    args.train_response = args.train_response or (768 if big else 96)
    args.train_steps = args.train_steps or (2 if q else 3)
    args.train_warmup = args.train_warmup if args.train_warmup is not None else (1 if q else 2)
    args.agree_per_policy = args.agree_per_policy or (2 if q else 4)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    b = Bench(args)
    run = [s for s in SECTIONS if s in args.sections]
    gpu = torch.cuda.get_device_name() if b.cuda else platform.processor() or "cpu"
    print(
        f"gpu_table: {gpu}, torch {torch.__version__}; shape {args.shape} {args.dtype}; sections {','.join(run)}"
        f"{' (quick)' if args.quick else ''}",
        flush=True,
    )
    functions = {"decode": section_decode, "publish": section_publish, "train": section_train, "agree": section_agree}
    for i, name in enumerate(run):
        start = time.perf_counter()
        if b.over_budget(args.budget_s):
            print(f"== {name}: skipped, the run is {b.elapsed():.0f} s old (--budget-s {args.budget_s:.0f})")
            b.sections[name] = {"seconds": 0.0, "error": None, "skipped": "budget"}
            continue
        print(f"== {name} (at {b.elapsed():.0f} s)", flush=True)
        error = None
        try:
            functions[name](b)
        except Exception as err:  # noqa: BLE001 - the next section still runs
            traceback.print_exc()
            error = f"{type(err).__name__}: {err}"[:500]
            print(f"  section {name} failed: {error}", flush=True)
        finally:
            if not set(run[i + 1 :]) & {"publish", "train", "agree"}:  # nobody needs the trainer any more
                b.drop_trainer()
            b.free()
        seconds = time.perf_counter() - start
        b.sections[name] = {"seconds": round(seconds, 2), "error": error}
        if b.cuda:
            b.sections[name]["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.reset_peak_memory_stats()
        print(f"== {name}: {seconds:.1f} s{'  (FAILED: ' + error + ')' if error else ''}", flush=True)
        b.write_json()
    b.drop_trainer()
    text = (
        table(b.rows)
        + "\nsections: "
        + ", ".join(
            f"{k} {v['seconds']:.1f} s" + (" FAILED" if v["error"] else "") + (" SKIPPED" if v.get("skipped") else "")
            for k, v in b.sections.items()
        )
        + f"; total {b.elapsed():.1f} s"
    )
    print()
    print(text)
    b.write_json()
    if args.json:
        Path(args.json).with_suffix(".txt").write_text(text + "\n")
        print(f"json: {args.json} (table: {Path(args.json).with_suffix('.txt')})")
    return 1 if any(v["error"] for v in b.sections.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
