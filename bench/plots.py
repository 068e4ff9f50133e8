"""Paper-style figures (PNG and PDF) from run folders, through bench.collect's merged tables.

    python -m bench.plots results/runs [more runs ...] --out results/figures

One figure per (trace, engine, sampling) group, plus an engine comparison per (trace, sampling)
where runs of two or more engines exist. Every function returns the paths it wrote.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from .collect import GROUP, Collection, collect  # noqa: E402
from .stats import accepted_length_hist  # noqa: E402

STYLE = {"figure.dpi": 110, "savefig.dpi": 200, "font.size": 10, "axes.titlesize": 10,
         "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
         "grid.alpha": 0.3, "grid.linewidth": 0.6, "legend.frameon": False,
         "savefig.bbox": "tight"}
BASELINE = "baseline"


def _colors(methods: Iterable[str]) -> dict[str, str]:
    others = sorted(m for m in set(methods) if m != BASELINE)
    palette = plt.get_cmap("tab10").colors
    return {BASELINE: "0.45", **{m: palette[i % 10] for i, m in enumerate(others)}}


def _short(sampling: str) -> str:
    """'temperature=1 top_p=0.9 ...' -> 'T=1, top-p=0.9, top-k=-1, max 48 tok, seed 0'."""
    s = dict(kv.split("=", 1) for kv in sampling.split())
    return (f"T={s.get('temperature')}, top-p={s.get('top_p')}, top-k={s.get('top_k')}, "
            f"max {s.get('max_new_tokens')} tok, seed {s.get('seed')}")


def _slug(*parts: str) -> str:
    short = [re.sub(r"[^A-Za-z0-9._+-]+", "-", str(p)).strip("-") for p in parts]
    return "__".join(p for p in short if p)


def _sampling_slug(sampling: str) -> str:
    s = dict(kv.split("=", 1) for kv in sampling.split())
    return "T{temperature}_p{top_p}_k{top_k}_n{max_new_tokens}_s{seed}".format_map(
        {k: s.get(k, "?") for k in ("temperature", "top_p", "top_k", "max_new_tokens", "seed")})


def _save(fig, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.{ext}" for ext in ("png", "pdf")]
    for p in paths:
        fig.savefig(p)
    plt.close(fig)
    return paths


def _groups(df: pd.DataFrame, keys=GROUP):
    for key, grp in df.groupby(list(keys), sort=True):
        yield dict(zip(keys, key)), grp


def _title(what: str, g: dict) -> str:
    where = f"trace {g['trace']}" + (f" · engine {g['engine']}" if "engine" in g else "")
    return f"{what}\n{where} · {_short(g['sampling'])}"


def _name(what: str, g: dict) -> str:
    return _slug(what, g["trace"], g.get("engine", ""), _sampling_slug(g["sampling"]))


def plot_speedup(col: Collection, out_dir: Path) -> list[Path]:
    """Bar per method: speedup over the baseline, error bars = spread across steps."""
    paths = []
    for g, grp in _groups(col.table):
        grp = grp[(grp["method"] != BASELINE) & grp["speedup"].notna()]
        if grp.empty:
            continue
        colors = _colors(col.table["method"])
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
            ax.set_title(_title("Rollout speedup (error bars: ± s.d. across steps)", g))
            paths += _save(fig, out_dir, _name("speedup", g))
    return paths


def plot_step_curves(col: Collection, out_dir: Path) -> list[Path]:
    """Tokens per forward pass and acceptance rate vs training step, one line per method."""
    paths = []
    colors = _colors(col.per_step["method"])
    for g, grp in _groups(col.per_step):
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
            fig.suptitle(_title("Drafting quality over training", g), fontsize=10)
            paths += _save(fig, out_dir, _name("step_curves", g))
    return paths


def plot_rollout_time(col: Collection, out_dir: Path) -> list[Path]:
    """Wall seconds of each step's rollouts, one line per method."""
    paths = []
    colors = _colors(col.per_step["method"])
    for g, grp in _groups(col.per_step):
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
            ax.set_title(_title("Rollout time per step", g))
            paths += _save(fig, out_dir, _name("rollout_time", g))
    return paths


def plot_accepted_length_hist(col: Collection, out_dir: Path) -> list[Path]:
    """Share of drafts by number of accepted tokens, bars per method (methods that draft)."""
    paths = []
    colors = _colors(col.rollouts["method"])
    hist = accepted_length_hist(col.rollouts, by=[*GROUP, "method"])
    hist = hist[hist.groupby([*GROUP, "method"])["drafts"].transform("sum") > 0]
    for g, grp in _groups(hist):
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
            ax.set_title(_title("Accepted-length distribution", g))
            paths += _save(fig, out_dir, _name("accepted_length", g))
    return paths


def plot_engine_comparison(col: Collection, out_dir: Path) -> list[Path]:
    """Grouped bars method x engine (speedup, tokens/s); only where >= 2 engines ran."""
    paths = []
    for g, grp in _groups(col.table, keys=("trace", "sampling")):
        engines = sorted(grp["engine"].unique())
        if len(engines) < 2:
            continue
        methods = sorted(grp["method"].unique(), key=lambda m: (m != BASELINE, m))
        width, x = 0.8 / len(engines), np.arange(len(methods))
        with plt.rc_context(STYLE):
            fig, axes = plt.subplots(1, 2, figsize=(max(9, 2.6 * len(methods)), 3.8),
                                     layout="constrained")
            for ax, metric, label in zip(axes, ("speedup", "tokens_per_s"),
                                         ("speedup over own engine's baseline (×)",
                                          "output tokens per second")):
                for i, engine in enumerate(engines):
                    e = grp[grp["engine"] == engine].set_index("method").reindex(methods)
                    err = e["speedup_std"] if metric == "speedup" else None
                    ax.bar(x + (i - (len(engines) - 1) / 2) * width, e[metric], width=width,
                           yerr=err, capsize=3, label=engine, color=plt.get_cmap("Set2")(i))
                ax.set_xticks(x, methods, rotation=20 if len(methods) > 3 else 0)
                ax.set_ylabel(label)
            axes[0].axhline(1.0, color="0.3", lw=1, ls="--")
            axes[0].legend(title="engine")
            fig.suptitle(_title("Engine comparison", g), fontsize=10)
            paths += _save(fig, out_dir, _name("engines", g))
    return paths


PLOTS = (plot_speedup, plot_step_curves, plot_rollout_time, plot_accepted_length_hist,
         plot_engine_comparison)


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
