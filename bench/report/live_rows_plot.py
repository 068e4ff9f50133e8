"""The tail of a step, drawn: live rows over rollout wall time within one step, baseline against the
best method (highest measured speedup), from iterations.parquet. Called by ``bench.report.plots``.

    python -m bench.report.plots results/runs --out results/figures     # writes live_rows__*.png/pdf too

The dotted line is ``bench.report.stats.TAIL_ROWS`` (8 live rows): the share of wall time below it is the
``tail_share`` column of the results table.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from bench.report.plot_style import BASELINE, STYLE, method_colors, figure_groups, figure_name, save_figure, figure_title
from bench.report.results import load_iterations
from bench.report.stats import TAIL_ROWS

SECONDS = ["forward_s", "verify_s", "drafter_s", "other_s"]


def live_rows_curve(iterations: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(start time of each engine iteration in seconds since the step began, its live rows)."""
    it = iterations.sort_values(["iteration", "call"])
    per = it.assign(s=it[SECONDS].fillna(0).sum(1)).groupby("iteration", sort=True).agg(
        s=("s", "sum"), live=("live_rows", "first"))
    start = np.concatenate([[0.0], np.cumsum(per["s"].to_numpy())[:-1]])
    return start, per["live"].to_numpy()


def plot_live_rows(col, out_dir: Path) -> list[Path]:
    """One figure per setup: the last common step, baseline vs the fastest method."""
    paths = []
    dirs = dict(zip(col.runs["run_id"], col.runs["run_dir"]))
    cache: dict[str, pd.DataFrame] = {}

    def iterations(run_id: str) -> pd.DataFrame:
        if run_id not in cache:
            cache[run_id] = load_iterations(dirs[run_id]) if run_id in dirs else pd.DataFrame()
        return cache[run_id]

    for g, grp in figure_groups(col.table):
        rivals = grp[(grp["method"] != BASELINE) & grp["speedup"].notna()]
        base = grp[grp["method"] == BASELINE]
        if rivals.empty or base.empty:
            continue
        best = rivals.loc[rivals["speedup"].idxmax()]
        series = [(BASELINE, base.iloc[0]["run_id"]), (best["method"], best["run_id"])]
        frames = []
        for method, run_id in series:
            it = iterations(run_id)
            frames.append(it[it["method"] == method] if not it.empty else it)
        if any(f.empty for f in frames):
            continue
        common = sorted(set(frames[0]["step"]) & set(frames[1]["step"]))
        if not common:
            continue
        step = common[-1]
        colors = method_colors(col.table["method"])
        with plt.rc_context(STYLE):
            fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
            for (method, _), f in zip(series, frames):
                t, live = live_rows_curve(f[f["step"] == step])
                total = t[-1] if len(t) else 0.0
                ax.step(np.append(t, total), np.append(live, 0), where="post", color=colors[method],
                        ls="--" if method == BASELINE else "-",
                        label=f"{method} ({total:.2f} s)" if method == BASELINE else
                        f"{method} ({total:.2f} s; mean speedup {best['speedup']:.2f}×)")
            ax.axhline(TAIL_ROWS, color="0.4", lw=0.8, ls=":")
            ax.text(0.99, TAIL_ROWS, f"{TAIL_ROWS} live rows ", transform=ax.get_yaxis_transform(),
                    ha="right", va="bottom", fontsize=8, color="0.35")
            ax.set_xlabel(f"rollout wall time within step {step} (s)")
            ax.set_ylabel("live rows (running rollouts)")
            ax.set_ylim(bottom=0)
            ax.legend()
            ax.set_title(figure_title("The tail of a step: live rows over time", g, col.table))
            paths += save_figure(fig, out_dir, figure_name("live_rows", g))
    return paths
