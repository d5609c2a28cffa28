"""`ouro compare`: two `ouro train` runs of one job placed differently (1 vs N data-parallel
ranks, one GPU vs prefill/decode workers, CPU vs GPU), judged within stated tolerances.

    ouro compare RUN_A RUN_B [--tolerance fp32|bf16] [--atol X] [--rtol R] [--weights-atol W]
                             [--min-identical F] [--max-update-diff D] [--json]

`ouro verify-resume --compare` asks for bit identity (verify_resume.py); this asks whether two placements
computed the same job within a stated tolerance, and shows where they part:

- plan (exact): per update, the same K and, per sample, the same prompt, position and
  seed: the same global batch. A difference here is a bug, never rounding.
- rollout tokens: per update, how many samples have identical response tokens and exit
  depths. Sampling is chaotic: a logit that differs in its last bit can flip a token
  whose uniform draw lies on a boundary, so bf16 runs may part; `--min-identical` is the
  fraction that must agree (default all).
- logprobs: max |Δ| of the engine's logprobs over samples with identical tokens.
- metrics, for updates whose samples are all identical (otherwise the two updates
  trained on different samples and are not comparable): reward_mean exactly (a pure
  function of the tokens), |Δ| of train_loss and logprob_mismatch_mean, and
  train_grad_norm within atol + rtol·|g| (a loss normalised per rank instead of over
  the global batch changes the gradient norm even where Adam hides it in the weights).
- weights: per tensor of the final checkpoints max |Δ| and mean |Δ|; every element
  must satisfy |Δ| <= weights_atol + rtol·|w_A| (weights_atol defaults to atol). Adam
  divides each gradient element by its own running scale, so an element whose gradient
  is at summation-noise level can move by up to ~lr per update in either run: for fp32
  runs that train with Adam, a weights_atol of the learning rate is the honest bound.
- training update: ‖w_B − w_A‖ / ‖w_A − w_0‖ over the fp32 main weights (the model's
  own where the optimizer keeps none), w_0 the starting model: the share of what run A
  learned that run B did not learn alike. It must not exceed --max-update-diff. Runs
  whose weights never moved agree when B equals A (0), and fail when it does not. In bf16
  at a small learning rate most weights never leave their bf16 value, so the elementwise
  check above cannot tell a run that trained alike from one that did not train; this
  one can (not training at all gives 1).
- throughput (reported, never judged): step, rollout and train tokens/s per run.

Logprob tolerances calibrate themselves. Each run measures how far its engine's logprobs
lie from its own trainer's on the same weights (logprob_mismatch_max, _mean); by the
triangle inequality the two engines may then disagree by the sum of the two runs'
mismatches, plus atol for what their trainers disagree on. That bounds a logprob (with
the _max) and token means of logprob differences, loss and mismatch (with the _mean).
In fp32 the floor is ~1e-5; in bf16 it is about one rounding step of the largest
logits (|z| < 16 on the tiny model: 2^-4 = 0.0625), which is also what one last-bit
weight difference does to a logprob.

The tolerances (`Tolerance`) come as a preset for the runs' dtype, each settable on its
own: fp32 atol 1e-5, rtol 0, min-identical 1, max-update-diff 1e-3; bf16 atol 1e-3, rtol
2^-7 (one bf16 rounding step), min-identical 0.9 (a one-ulp weight difference flips a token
now and then and the sample parts from there), max-update-diff 0.1.

Exit 0 when everything is within tolerance, 1 when something is not, 2 on bad input.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ouro_cli.errors import UserError
from ouro_cli.rl.metrics import read_jsonl
from ouro_cli.rl.run_dir import RunDir

PLAN_KEYS = ("problem_id", "group", "seed", "k", "prompt_ids")
TOKEN_KEYS = ("response_ids", "exit_depths")
METRIC_KEYS = ("train_loss", "logprob_mismatch_mean")  # token means of logprob differences


@dataclass(frozen=True)
class Tolerance:
    """What two placements of one job may differ by (module docstring)."""

    atol: float = 1e-5  # weights and the gradient norm; the floor of the logprob tolerances
    rtol: float = 0.0  # |Δ| <= atol + rtol·|w|
    weights_atol: float | None = None  # the weights' own atol (None: atol); fp32 Adam runs: the LR
    min_identical: float = 1.0  # fraction of samples whose tokens must be identical
    max_update_diff: float = 1e-3  # largest ‖w_B − w_A‖ / ‖w_A − w_0‖

    def with_(self, **given: float | None) -> Tolerance:
        """These tolerances with the ones given (not None) replaced."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})


PRESETS = {"fp32": Tolerance(), "bf16": Tolerance(atol=1e-3, rtol=2**-7, min_identical=0.9, max_update_diff=0.1)}


class Run:
    """One run directory's records: metrics by update, rollouts on demand."""

    def __init__(self, root: Path) -> None:
        self.dir = RunDir(root)
        if not self.dir.is_run():
            raise UserError(f"{root} is not an ouro run directory (no {self.dir.plan.name})")
        self.metrics = {m["update"]: m for m in read_jsonl(self.dir.metrics)}
        if not self.metrics:
            raise UserError(f"{root} has no metrics.jsonl lines")

    def rollouts(self, update: int) -> list[dict[str, Any]]:
        return read_jsonl(self.dir.rollout_file(update))


def _logprobs(record: dict[str, Any]) -> list[float]:
    return [float.fromhex(x) for x in record["logprobs"]]


def _both(ma: dict[str, Any], mb: dict[str, Any], key: str) -> float:
    return (ma.get(key) or 0.0) + (mb.get(key) or 0.0)


def _within(row: dict[str, Any], key: str, tol: float) -> bool:
    return row[f"{key}_diff"] is None or row[f"{key}_diff"] <= tol


def compare_updates(a: Run, b: Run, atol: float, rtol: float) -> list[dict[str, Any]]:
    rows = []
    for update in sorted(set(a.metrics) | set(b.metrics)):
        ma, mb = a.metrics.get(update), b.metrics.get(update)
        row: dict[str, Any] = {"update": update}
        if ma is None or mb is None:
            row["problem"] = f"update {update} is missing in run {'A' if ma is None else 'B'}"
            rows.append(row)
            continue
        ra, rb = a.rollouts(update), b.rollouts(update)
        plan_same = (
            ma["k"] == mb["k"]
            and len(ra) == len(rb)
            and all(all(x.get(key) == y.get(key) for key in PLAN_KEYS) for x, y in zip(ra, rb, strict=False))
        )
        identical = [all(x[key] == y[key] for key in TOKEN_KEYS) for x, y in zip(ra, rb, strict=False)]
        lp = [
            abs(p - q)
            for x, y, same in zip(ra, rb, identical, strict=False)
            if same
            for p, q in zip(_logprobs(x), _logprobs(y), strict=True)
        ]
        row.update(
            k=ma["k"],
            plan_same=plan_same,
            samples=len(ra),
            identical=sum(identical),
            logprob_max_diff=max(lp, default=None),
            logprob_tol=atol + _both(ma, mb, "logprob_mismatch_max"),
            mean_tol=atol + _both(ma, mb, "logprob_mismatch_mean"),
        )
        for key in (*METRIC_KEYS, "train_grad_norm"):
            va, vb = ma.get(key), mb.get(key)
            row[f"{key}_diff"] = abs(va - vb) if va is not None and vb is not None else None
        row["reward_mean_a"], row["reward_mean_b"] = ma["reward_mean"], mb["reward_mean"]
        row["metrics_compared"] = plan_same and row["identical"] == row["samples"]
        row["ok"] = (
            plan_same
            and (row["logprob_max_diff"] or 0.0) <= row["logprob_tol"]
            and (
                not row["metrics_compared"]
                or (
                    ma["reward_mean"] == mb["reward_mean"]
                    and all(_within(row, k, row["mean_tol"]) for k in METRIC_KEYS)
                    and _within(row, "train_grad_norm", atol + rtol * abs(ma.get("train_grad_norm") or 0.0))
                )
            )
        )
        rows.append(row)
    return rows


def update_agreement(a: Run, b: Run, model_a: dict[str, Any]) -> dict[str, Any]:
    from ouro_cli.checkpoint import CheckpointError, read_checkpoint
    from ouro_cli.rl.plan import read_plan

    from .verify_resume import checkpoint_tensors

    start = read_plan(a.dir.plan)["options"]["model"]
    try:
        _, initial = read_checkpoint(start)
    except (UserError, CheckpointError) as err:
        return {"rel_diff": None, "start": start, "note": f"starting model unreadable: {err}"}
    full_a, _ = checkpoint_tensors(a.dir)
    full_b, _ = checkpoint_tensors(b.dir)
    missing = sorted(n for n in initial if n not in full_a or n not in full_b or n not in model_a)
    if missing:
        return {"rel_diff": None, "start": start, "note": f"{missing[0]} of the starting model is not in both runs"}
    diff2 = moved2 = 0.0
    main = 0
    for name, w0 in initial.items():
        key = f"optimizer.state.fp32_param.{name}"
        if key in full_a and key in full_b:
            main += 1
        else:
            key = name
        wa, wb = full_a[key].double(), full_b[key].double()
        # the trainer's fp32 main weights start as the model-dtype copy of the checkpoint
        w0 = w0.to(model_a[name].dtype).double()
        diff2 += float(((wb - wa) ** 2).sum())
        moved2 += float(((wa - w0) ** 2).sum())
    return {
        **relative_update_diff(diff2, moved2),
        "start": start,
        "fp32_main_tensors": main,
        "moved_norm": math.sqrt(moved2),
        "diff_norm": math.sqrt(diff2),
    }


def relative_update_diff(diff2: float, moved2: float) -> dict[str, Any]:
    """‖w_B − w_A‖ / ‖w_A − w_0‖ from the squared norms. When run A never moved from w_0 the
    ratio has no denominator: B equal to A agrees exactly (0), B elsewhere cannot be judged (None)."""
    if moved2 > 0:
        return {"rel_diff": math.sqrt(diff2 / moved2)}
    if diff2 == 0:
        return {"rel_diff": 0.0, "note": "neither run moved its weights from w_0: they agree exactly"}
    return {"rel_diff": None, "note": "run A's weights never moved from w_0 and run B's differ from them"}


def compare_weights(a: Run, b: Run, atol: float, rtol: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import torch

    from ouro_cli.checkpoint import read_checkpoint

    _, ta = read_checkpoint(a.dir.root)
    _, tb = read_checkpoint(b.dir.root)
    rows = []
    for name in sorted(set(ta) | set(tb)):
        x, y = ta.get(name), tb.get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            rows.append(
                {
                    "tensor": name,
                    "ok": False,
                    "problem": "missing"
                    if x is None or y is None
                    else f"{tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}",
                }
            )
            continue
        xd, yd = x.double(), y.double()
        diff = (xd - yd).abs()
        excess = diff - (atol + rtol * xd.abs())
        rows.append(
            {
                "tensor": name,
                "dtype": str(x.dtype).removeprefix("torch."),
                "numel": x.numel(),
                "max_abs_diff": float(diff.max()) if x.numel() else 0.0,
                "mean_abs_diff": float(diff.mean()) if x.numel() else 0.0,
                "differing": int((diff > 0).sum()),
                "bitwise_equal": bool(torch.equal(x, y)),
                "ok": bool((excess <= 0).all()),
            }
        )
    return rows, update_agreement(a, b, ta)


def throughput(run: Run) -> dict[str, Any]:
    """Means over the updates after the first (which pays for warm-up: CUDA graphs, compilation),
    or over all when there is one; the final save is left out of the step time."""
    ms = [run.metrics[u] for u in sorted(run.metrics)]
    steady = ms[1:] if len(ms) > 1 else ms

    def mean(values: list[float]) -> float | None:
        values = [v for v in values if v is not None and math.isfinite(v)]
        return statistics.fmean(values) if values else None

    def rate(tokens: list[int], seconds: list[float]) -> float | None:
        return sum(tokens) / sum(seconds) if sum(seconds) > 0 else None

    return {
        "ranks": ms[0].get("ranks", 1),
        "kv_transport": ms[0].get("kv_transport"),
        "updates_measured": len(steady),
        "step_s": mean([m["step_s"] - m.get("save_s", 0.0) for m in steady]),
        "rollout_tok_s": rate(
            [sum(m.get("response_lengths", [])) for m in steady], [m.get("rollout_s") or 0.0 for m in steady]
        ),
        "train_tok_s": rate([m.get("train_tokens") or 0 for m in steady], [m.get("train_s") or 0.0 for m in steady]),
        "job_elapsed_s": ms[-1].get("job_elapsed_s"),
    }


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def report(a: Path, b: Path, tolerance: Tolerance) -> dict[str, Any]:
    """The whole comparison of run B against run A as one JSON-ready document; `ok` when every
    check is within `tolerance`."""
    run_a, run_b = Run(a), Run(b)
    atol, rtol, min_identical = tolerance.atol, tolerance.rtol, tolerance.min_identical
    max_update_diff = tolerance.max_update_diff
    weights_atol = atol if tolerance.weights_atol is None else tolerance.weights_atol
    updates = compare_updates(run_a, run_b, atol, rtol)
    weights, agreement = compare_weights(run_a, run_b, weights_atol, rtol)
    samples = sum(u.get("samples", 0) for u in updates)
    identical = sum(u.get("identical", 0) for u in updates)
    fraction = identical / samples if samples else 0.0
    checks = {
        "plan": all(u.get("plan_same", False) for u in updates),
        "rollout_tokens": samples > 0 and fraction >= min_identical,
        "logprobs_and_metrics": all(u.get("ok", False) for u in updates),
        "weights": bool(weights) and all(w["ok"] for w in weights),
        "training_update": agreement["rel_diff"] is not None and agreement["rel_diff"] <= max_update_diff,
    }
    return {
        "run_a": str(a),
        "run_b": str(b),
        "atol": atol,
        "rtol": rtol,
        "weights_atol": weights_atol,
        "min_identical": min_identical,
        "max_update_diff": max_update_diff,
        "training_update": agreement,
        "ok": all(checks.values()),
        "checks": checks,
        "samples": samples,
        "identical_samples": identical,
        "identical_fraction": fraction,
        "updates": updates,
        "weights": weights,
        "weights_max_abs_diff": max((w.get("max_abs_diff", math.inf) for w in weights), default=None),
        "weights_bitwise_equal": all(w.get("bitwise_equal", False) for w in weights),
        "throughput": {"a": throughput(run_a), "b": throughput(run_b)},
    }


def format_report(doc: dict[str, Any]) -> str:
    """`report`'s document as the text tables `ouro compare` prints."""
    out: list[str] = []

    def add(text: str) -> None:
        out.extend(text.split("\n"))

    add(
        f"A = {doc['run_a']}\nB = {doc['run_b']}\natol {doc['atol']:g}, rtol {doc['rtol']:g}, "
        f"weights atol {doc['weights_atol']:g}, "
        f"min identical {doc['min_identical']:g}, max update diff {doc['max_update_diff']:g}\n"
    )
    rows = []
    for u in doc["updates"]:
        if "problem" in u:
            rows.append([str(u["update"]), "-", u["problem"], *["-"] * 8])
            continue
        note = "" if u["metrics_compared"] else " (tokens differ: metrics not judged)"
        rows.append(
            [
                str(u["update"]),
                str(u["k"]),
                _fmt(u["plan_same"]),
                f"{u['identical']}/{u['samples']}",
                f"{_fmt(u['logprob_max_diff'])} ≤ {_fmt(u['logprob_tol'])}",
                _fmt(u["train_loss_diff"]),
                _fmt(u["logprob_mismatch_mean_diff"]),
                f"≤ {_fmt(u['mean_tol'])}",
                _fmt(u["train_grad_norm_diff"]),
                f"{u['reward_mean_a']:.4f}/{u['reward_mean_b']:.4f}",
                _fmt(u["ok"]) + note,
            ]
        )
    add(
        _table(
            [
                "update",
                "K",
                "plan",
                "identical",
                "max|Δlogp| ≤ tol",
                "|Δloss|",
                "|Δmismatch|",
                "tol",
                "|Δgrad_norm|",
                "reward A/B",
                "ok",
            ],
            rows,
        )
    )
    w = doc["weights"]
    worst = sorted(w, key=lambda r: -r.get("max_abs_diff", math.inf))[:5]
    add(
        f"\nweights: {len(w)} tensors, {sum(r.get('bitwise_equal', False) for r in w)} bitwise equal, "
        f"{sum(not r['ok'] for r in w)} beyond tolerance; largest differences:"
    )
    add(
        _table(
            ["tensor", "dtype", "max|Δ|", "mean|Δ|", "differing", "ok"],
            [
                [
                    r["tensor"],
                    r.get("dtype", "-"),
                    _fmt(r.get("max_abs_diff")),
                    _fmt(r.get("mean_abs_diff")),
                    f"{r.get('differing', '-')}/{r.get('numel', '-')}",
                    _fmt(r["ok"]),
                ]
                for r in worst
            ],
        )
    )
    agreement = doc["training_update"]
    add(
        f"training update: ‖w_B − w_A‖ / ‖w_A − w_0‖ = {_fmt(agreement['rel_diff'])} "
        f"(limit {doc['max_update_diff']:g}; {agreement.get('fp32_main_tensors', 0)} tensors as fp32 main weights; "
        f"w_0 = {agreement['start']}){' ' + agreement['note'] if agreement.get('note') else ''}"
    )
    ta, tb = doc["throughput"]["a"], doc["throughput"]["b"]

    def ratio(key: str) -> str:
        return f"{tb[key] / ta[key]:.2f}x" if ta.get(key) and tb.get(key) else "-"

    add("\nthroughput (updates after the first; step time without the final save):")
    add(
        _table(
            ["", "ranks", "step_s", "rollout tok/s", "train tok/s"],
            [
                [
                    "A",
                    str(ta["ranks"]),
                    _fmt(ta["step_s"]),
                    _fmt(ta["rollout_tok_s"], ".0f"),
                    _fmt(ta["train_tok_s"], ".0f"),
                ],
                [
                    "B",
                    str(tb["ranks"]),
                    _fmt(tb["step_s"]),
                    _fmt(tb["rollout_tok_s"], ".0f"),
                    _fmt(tb["train_tok_s"], ".0f"),
                ],
                ["B/A", "", ratio("step_s"), ratio("rollout_tok_s"), ratio("train_tok_s")],
            ],
        )
    )
    checks = " ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in doc["checks"].items())
    add(
        f"\nidentical rollouts {doc['identical_samples']}/{doc['samples']}; weights max|Δ| "
        f"{_fmt(doc['weights_max_abs_diff'])}{' (bitwise equal)' if doc['weights_bitwise_equal'] else ''}"
    )
    add(f"{'WITHIN TOLERANCE' if doc['ok'] else 'BEYOND TOLERANCE'}: {checks}")
    return "\n".join(out)
