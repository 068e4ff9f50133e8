"""Paper-style figures (PNG and PDF) from run folders, through bench.report.collect's merged tables.

    python -m bench.report.plots results/runs [more runs ...] --out results/figures

One figure per setup (``bench.report.collect.GROUP``: trace, engine, engine settings, hardware,
sampling), plus an engine comparison per (trace, sampling) where runs of two or more engines
exist, one bar series per engine setup. A file name carries the trace, the engine, a short hash of
the engine settings and hardware (``setup_id``, e.g. ``s3f9a1c``: two setups of one engine never
share a file) and the sampling; a title names the keys in which the engine's setups differ
(``setup_label``). Every function returns the paths it wrote.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.report.collect import GROUP, Collection, collect  # noqa: E402
from bench.report.stats import accepted_length_hist  # noqa: E402
from bench.report.plot_style import (BASELINE, STYLE, figure_groups, figure_name, figure_title,  # noqa: E402
                                     method_colors, save_figure, setup_label)


def plot_speedup(col: Collection, out_dir: Path) -> list[Path]:
    """Bar per method: speedup over the baseline, error bars = spread across steps."""
    paths = []
    for g, grp in figure_groups(col.table):
        grp = grp[(grp["method"] != BASELINE) & grp["speedup"].notna()]
        if grp.empty:
            continue
        colors = method_colors(col.table["method"])
        with plt.rc_context(STYLE):
            fig, ax = plt.subplots(figsize=(max(4.8, 1.2 * len(grp)), 3.6), layout="constrained")
            x = np.arange(len(grp))
            ax.bar(x, grp["speedup"], yerr=grp["speedup_std"], capsize=4, width=0.55,
                   color=[colors[m] for m in grp["method"]], error_kw={"elinewidth": 1})
            ax.axhline(1.0, color="0.3", lw=1, ls="--")
            ax.text(1.0, 1.0, "baseline ", transform=ax.get_yaxis_transform(), ha="right",
                    va="bottom", fontsize=8, color="0.3")
            for xi, v in zip(x, grp["speedup"]):
                ax.text(xi, 0.03, f"{v:.2f}×", ha="center", va="bottom", color="white",
                        fontsize=9, fontweight="bold", transform=ax.get_xaxis_transform())
            ax.set_xticks(x, grp["method"], rotation=20 if len(grp) > 3 else 0)
            ax.set_ylabel("speedup over baseline (×)")
            ax.set_title(figure_title("Rollout speedup (error bars: ± s.d. across steps)", g, col.table))
            paths += save_figure(fig, out_dir, figure_name("speedup", g))
    return paths


def plot_step_curves(col: Collection, out_dir: Path) -> list[Path]:
    """Tokens per forward pass and acceptance rate vs training step, one line per method."""
    paths = []
    colors = method_colors(col.per_step["method"])
    for g, grp in figure_groups(col.per_step):
        with plt.rc_context(STYLE):
            fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharex=True, layout="constrained")
            for method, m in grp.sort_values("step").groupby("method"):
                for ax, metric in zip(axes, ("tokens_per_step", "acceptance_rate")):
                    if m[metric].notna().any():
                        ax.plot(m["step"], m[metric], marker="o", ms=3, label=method,
                                color=colors[method])
            axes[0].set_ylabel("tokens per forward pass")
            axes[1].set_ylabel("acceptance rate (accepted / drafted)")
            axes[1].set_ylim(0, 1)
            for ax in axes:
                ax.set_xlabel("training step")
                ax.xaxis.get_major_locator().set_params(integer=True)
            axes[0].legend()
            fig.suptitle(figure_title("Drafting quality over training", g, col.table), fontsize=10)
            paths += save_figure(fig, out_dir, figure_name("step_curves", g))
    return paths


def plot_rollout_time(col: Collection, out_dir: Path) -> list[Path]:
    """Wall seconds of each step's rollouts, one line per method."""
    paths = []
    colors = method_colors(col.per_step["method"])
    for g, grp in figure_groups(col.per_step):
        with plt.rc_context(STYLE):
            fig, ax = plt.subplots(figsize=(5.5, 3.6), layout="constrained")
            for method, m in grp.sort_values("step").groupby("method"):
                ax.plot(m["step"], m["rollout_wall_s"], marker="o", ms=3, label=method,
                        color=colors[method], ls="--" if method == BASELINE else "-")
            ax.set_xlabel("training step")
            ax.set_ylabel("rollout wall time per step (s)")
            ax.set_ylim(bottom=0)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.legend()
            ax.set_title(figure_title("Rollout time per step", g, col.table))
            paths += save_figure(fig, out_dir, figure_name("rollout_time", g))
    return paths


def plot_accepted_length_hist(col: Collection, out_dir: Path) -> list[Path]:
    """Share of drafts by number of accepted tokens, bars per method (methods that draft)."""
    paths = []
    colors = method_colors(col.rollouts["method"])
    hist = accepted_length_hist(col.rollouts, by=[*GROUP, "method"])
    hist = hist[hist.groupby([*GROUP, "method"])["drafts"].transform("sum") > 0]
    for g, grp in figure_groups(hist):
        methods = sorted(grp["method"].unique())
        top = int(grp.loc[grp["drafts"] > 0, "accepted_length"].max())
        width = 0.8 / len(methods)
        with plt.rc_context(STYLE):
            fig, ax = plt.subplots(figsize=(min(12, max(5.5, 0.3 * (top + 1) * len(methods))), 3.6),
                                   layout="constrained")
            for i, method in enumerate(methods):
                m = grp[(grp["method"] == method) & (grp["accepted_length"] <= top)]
                ax.bar(m["accepted_length"] + (i - (len(methods) - 1) / 2) * width, m["fraction"],
                       width=width, label=method, color=colors[method])
            ax.set_xlabel("accepted draft tokens per verified draft")
            ax.set_ylabel("fraction of drafts")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.legend()
            ax.set_title(figure_title("Accepted-length distribution", g, col.table))
            paths += save_figure(fig, out_dir, figure_name("accepted_length", g))
    return paths


def plot_engine_comparison(col: Collection, out_dir: Path) -> list[Path]:
    """Grouped bars method x engine setup (speedup, tokens/s); only where >= 2 engines ran. An
    engine with several setups (settings or hardware) gets one series per setup."""
    paths = []
    for g, grp in figure_groups(col.table, keys=("trace", "sampling")):
        if grp["engine"].nunique() < 2:
            continue
        series = sorted(set(zip(grp["engine"], grp["engine_config"], grp["hardware"])))
        methods = sorted(grp["method"].unique(), key=lambda m: (m != BASELINE, m))
        width, x = 0.8 / len(series), np.arange(len(methods))
        with plt.rc_context(STYLE):
            fig, axes = plt.subplots(1, 2, figsize=(max(9, 0.9 * len(series) * len(methods) + 2), 3.8),
                                     layout="constrained")
            for ax, metric, label in zip(axes, ("speedup", "tokens_per_s"),
                                         ("speedup over own setup's baseline (×)",
                                          "output tokens per second")):
                for i, (engine, config, hardware) in enumerate(series):
                    e = grp[(grp["engine"] == engine) & (grp["engine_config"] == config)
                            & (grp["hardware"] == hardware)].set_index("method").reindex(methods)
                    err = e["speedup_std"] if metric == "speedup" else None
                    setup = setup_label(col.table, engine, config, hardware)
                    ax.bar(x + (i - (len(series) - 1) / 2) * width, e[metric], width=width,
                           yerr=err, capsize=3, label=f"{engine} ({setup})" if setup else engine,
                           color=plt.get_cmap("Set2")(i % 8))
                ax.set_xticks(x, methods, rotation=20 if len(methods) > 3 else 0)
                ax.set_ylabel(label)
            axes[0].axhline(1.0, color="0.3", lw=1, ls="--")
            fig.legend(*axes[0].get_legend_handles_labels(), title="engine (setup)", fontsize=8,
                       loc="outside lower center", ncols=min(3, len(series)))
            fig.suptitle(figure_title("Engine comparison", g), fontsize=10)
            paths += save_figure(fig, out_dir, figure_name("engines", g))
    return paths


def plot_live_rows(col: Collection, out_dir: Path) -> list[Path]:
    """Live rows over time within a step, baseline vs the best method (bench.report.live_rows_plot)."""
    from bench.report.live_rows_plot import plot_live_rows as plot
    return plot(col, out_dir)


PLOTS = (plot_speedup, plot_step_curves, plot_rollout_time, plot_accepted_length_hist,
         plot_engine_comparison, plot_live_rows)


def make_figures(runs: Collection | Iterable[str | Path], out_dir: str | Path,
                 progress: bool = True) -> list[Path]:
    """Every figure for the runs (a Collection or run folders/roots); returns written paths."""
    col = runs if isinstance(runs, Collection) else collect(runs, progress=progress)
    return [p for plot in PLOTS for p in plot(col, Path(out_dir))]


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="run folders or folders containing runs")
    ap.add_argument("--out", type=Path, required=True, help="folder for the PNG and PDF files")
    args = ap.parse_args(argv)
    paths = make_figures(args.paths, args.out)
    print("\n".join(map(str, paths)))
    return paths


if __name__ == "__main__":
    main()
