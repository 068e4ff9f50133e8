"""The simulator's predictions drawn: predicted speedup per method and target, and the tail of a
step (live rows over predicted time), baseline against the method predicted fastest.

    python -m bench.harness.simulate TRACE --method all --predict h200:llama-3.1-8b --figures results/figures/sim

Every figure is labelled *predicted*: the schedule is simulated (the engine's, by construction)
and its seconds are a table's or a roofline's, plus the drafter's seconds measured here.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from bench.report.stats import TAIL_ROWS


def predicted_speedup_figure(predicted: pd.DataFrame, out: Path) -> Path:
    """Bars: each method's mean predicted speedup over its steps, one bar per target."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    g = predicted.groupby(["target", "method"], sort=False)["predicted_s"].mean().reset_index()
    base = g[g["method"] == "baseline"].set_index("target")["predicted_s"]
    g["speedup"] = g["target"].map(base) / g["predicted_s"]
    methods = [m for m in g["method"].drop_duplicates() if m != "baseline"]
    targets = list(g["target"].drop_duplicates())
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(methods) + 2), 4.4))
    width = 0.8 / max(1, len(targets))
    x = np.arange(len(methods))
    for i, t in enumerate(targets):
        vals = g[g["target"] == t].set_index("method")["speedup"]
        ax.bar(x + i * width, [vals.get(m, np.nan) for m in methods], width, label=t, hatch="//", alpha=0.85)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x + width * (len(targets) - 1) / 2, methods, rotation=30, ha="right")
    ax.set_ylabel("predicted rollout speedup over baseline")
    ax.set_title("Predicted from the simulated schedule (not measured)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=min(3, len(targets)), frameon=False)
    fig.tight_layout()
    return _save(fig, out)


def live_rows_figure(iterations: pd.DataFrame, predicted: pd.DataFrame, target: dict, out: Path) -> Path:
    """Live rows over predicted seconds within the last simulated step: the baseline and the method
    with the highest mean predicted speedup on ``target`` (a dict with a table or hardware and model)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.spec.latency import pass_seconds
    forward, label = pass_seconds(iterations, target.get("table"), target.get("hardware"), target.get("model"))
    it = iterations.assign(predicted_s=forward + iterations["drafter_s"].fillna(0).to_numpy())
    mine = predicted[predicted["target"] == label].groupby("method")["predicted_s"].mean()
    speed = (mine["baseline"] / mine).drop("baseline")  # as the bars: mean seconds over the mean
    step = int(it["step"].max())
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for method in ["baseline"] + ([speed.idxmax()] if len(speed) else []):
        part = it[(it["method"] == method) & (it["step"] == step)].sort_values(["iteration", "call"])
        per = part.groupby("iteration", sort=True).agg(s=("predicted_s", "sum"), live=("live_rows", "first"))
        start = np.concatenate([[0.0], np.cumsum(per["s"].to_numpy())])
        text = f"{method} ({start[-1]:.3g} s)" if method == "baseline" else \
            f"{method} ({start[-1]:.3g} s; predicted speedup {speed[method]:.2f}x)"
        ax.step(start, np.append(per["live"].to_numpy(), 0), where="post", ls="--" if method == "baseline" else "-",
                label=text)
    ax.axhline(TAIL_ROWS, color="0.4", lw=0.8, ls=":")
    ax.set_xlabel(f"predicted seconds within step {step} ({label})")
    ax.set_ylabel("live rows (running rollouts)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title("The tail of a step, predicted (not measured)", fontsize=10)
    fig.tight_layout()
    return _save(fig, out)


def _save(fig, out: Path) -> Path:
    import matplotlib.pyplot as plt
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def write_figures(iterations: pd.DataFrame, predicted: pd.DataFrame, targets: list[dict], out_dir: Path) -> list[Path]:
    """Both figures into ``out_dir``: predicted_speedup.png and live_rows__TARGET.png per target."""
    import re

    from bench.spec.latency import pass_seconds
    paths = [predicted_speedup_figure(predicted, out_dir / "predicted_speedup.png")]
    for target in targets:
        _, label = pass_seconds(iterations.head(1), target.get("table"), target.get("hardware"), target.get("model"))
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", label.replace("roofline ", "")).strip("-")[:60]
        paths.append(live_rows_figure(iterations, predicted, target, out_dir / f"live_rows__{slug}.png"))
    return paths


__all__ = ["live_rows_figure", "predicted_speedup_figure", "write_figures"]
