"""metrics.png: a run's progress as a person reads it, per decode budget K.

Six panels, every series drawn once per K the run decodes at (one colour per K):

    training reward          held-out accuracy         mean exit depth
    logprob mismatch         time per update           response length

- training reward: each update's mean reward (points) and a running mean over the
  updates at that K (line), since the updates of one K are the comparable ones;
- held-out accuracy: every evaluation in evaluations.jsonl (start, interval, end);
- mean exit depth: how many loops a decoded token ran; under `--exit-threshold` it
  falls below K, which is the point of threshold exits;
- logprob mismatch: mean |engine - trainer| logprob per update, log scale (the max is
  the faint line): where the two policies part;
- time per update: rollout / train / publish / save stacked, so a slow phase shows;
- response length: mean tokens per sample, with the truncation count as a label.

Drawn at the end of a run that asked for it (`--plot`) and by `ouro plot RUN`, from the files
alone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .metrics import read_jsonl

PHASES = (
    ("rollout_s", "rollout"),
    ("refill_s", "refill"),
    ("train_s", "train"),
    ("publish_s", "publish"),
    ("save_s", "save"),
)
RUNNING_MEAN = 5


def _by_k(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    grouped: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        grouped[int(r["k"])].append(r)
    return dict(sorted(grouped.items()))


def _running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(
    metrics_path: Path, evaluations_path: Path, out: Path, log: Callable[[str], None] = lambda s: None
) -> Path | None:
    """Draw `out` from a run's metrics.jsonl and evaluations.jsonl (a last line cut short is
    left out, said in `log`); None without records, or without matplotlib (a bare GPU image
    may lack it: the run itself is not at fault)."""
    records = read_jsonl(metrics_path, log)
    if not records:
        return None
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None

    evaluations = read_jsonl(evaluations_path, log)
    per_k = _by_k(records)
    colours = {k: colormaps["tab10"](i) for i, k in enumerate(sorted(set(per_k) | {int(e["k"]) for e in evaluations}))}
    fig = Figure(figsize=(15, 7.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    (reward, accuracy, depth), (mismatch, timing, length) = axes

    for k, rows in per_k.items():
        c, u = colours[k], [r["update"] for r in rows]
        rewards = [r["reward_mean"] for r in rows]
        reward.scatter(u, rewards, color=c, s=12, alpha=0.5)
        reward.plot(u, _running_mean(rewards, RUNNING_MEAN), color=c, label=f"K={k}")
        depth.plot(u, [r.get("mean_exit_depth") for r in rows], color=c, marker=".", label=f"K={k}")
        means = [r.get("logprob_mismatch_mean") for r in rows]
        if any(m for m in means):
            mismatch.plot(u, means, color=c, marker=".", label=f"K={k} mean")
            mismatch.plot(u, [r.get("logprob_mismatch_max") for r in rows], color=c, alpha=0.3, lw=0.8)
        lengths = [sum(r["response_lengths"]) / max(len(r["response_lengths"]), 1) for r in rows]
        length.plot(u, lengths, color=c, marker=".", label=f"K={k}")
    for k, rows in _by_k(evaluations).items():
        rows = sorted(rows, key=lambda e: e["update"])
        accuracy.plot(
            [e["update"] for e in rows], [e["accuracy"] for e in rows], color=colours[k], marker="o", label=f"K={k}"
        )

    updates = [r["update"] for r in records]
    bottom = [0.0] * len(records)
    for key, name in PHASES:
        values = [float(r.get(key) or 0.0) for r in records]
        timing.bar(updates, values, bottom=bottom, label=name, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]

    reward.set_title(f"training reward (line: running mean of {RUNNING_MEAN} at that K)")
    accuracy.set_title("held-out accuracy")
    depth.set_title("mean exit depth of decoded tokens")
    mismatch.set_title("engine vs trainer |Δ logprob| (faint: max)")
    timing.set_title("seconds per update")
    length.set_title("mean response tokens")
    if mismatch.lines:
        mismatch.set_yscale("log")
    if not evaluations:
        accuracy.text(0.5, 0.5, "no evaluations", ha="center", va="center", transform=accuracy.transAxes)
    for ax in axes.flat:
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100, format=Path(out).suffix[1:] or "png")  # the name as given, no suffix added
    return out
