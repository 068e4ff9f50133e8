"""What the closed loop learnt, per setting: reward curves with a band over seeds, a final-reward
table with 95% intervals, end-to-end step time split into rollout and training, and the KL from
the baseline run's policy.

    python -m bench.train.report [results/train] [--out results/figures/train] [--last 4]

Runs are compared within a study (same task, steps, dtype and warm start) and paired by seed:
a setting's run and the baseline's run of the same seed share the prompt order and the coupled
uniforms, so the per-seed difference of their final rewards is the sharpest test of whether a rule
changes what is learnt. "Final reward" is the mean reward of a run's last ``--last`` steps. The KL
at a step is the mean per-position KL(setting || baseline) of the two policies that generated that
step, on the held-out sequences (``bench.train.warmstart``). Seconds are measured here, per step,
side by side in one sweep; speedups are ratios of mean step seconds.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from bench.core.errors import UserError, run_main
from bench.report.stats import mean_ci95
from bench.train.store import CONFIG, TrainRunFolder
from bench.train.warmstart import mean_kl

BASELINE = "baseline"


def load_runs(root: Path) -> pd.DataFrame:
    """Every committed step row under ``root`` (one folder per run), with KL and weight identity
    against the baseline run of the same study and seed."""
    root = Path(root)
    if not root.exists():
        raise UserError(f"{root} does not exist: run the closed loop first (python -m bench.train -m)")
    folders = {p.name: TrainRunFolder(p) for p in sorted(root.iterdir()) if (p / CONFIG).exists()}
    frames = [f.rows() for f in folders.values()]
    frames = [f for f in frames if not f.empty]
    if not frames:
        raise UserError(f"{root} holds no closed-loop steps yet: run python -m bench.train first")
    df = pd.concat(frames, ignore_index=True)
    runs = df.groupby(["study", "setting", "seed"])["run_id"].unique()
    clash = runs[runs.map(len) > 1]
    if len(clash):
        (study, setting, seed), ids = next(iter(clash.items()))
        raise UserError(f"{root}: runs {', '.join(sorted(ids))} are all setting {setting!r}, seed {seed} of study "
                        f"{study} (they differ in a knob the label does not show); report them from separate "
                        f"results_root folders")
    df["kl_from_baseline"] = np.nan
    df["weights_identical"] = pd.Series([None] * len(df), dtype=object)
    base = df[df["method"] == BASELINE]
    base_sha = {(r.study, r.seed, r.step): r.weights_sha1 for r in base.itertuples()}
    base_run = {(r.study, r.seed): r.run_id for r in base.itertuples()}
    cache: dict[tuple[str, int], np.ndarray | None] = {}

    def heldout(run_id: str, step: int):
        if (run_id, step) not in cache:
            cache[(run_id, step)] = folders[run_id].heldout(step) if run_id in folders else None
        return cache[(run_id, step)]

    for i, r in enumerate(df.itertuples()):
        ref = base_run.get((r.study, r.seed))
        if ref is None:
            continue
        mine, theirs = heldout(r.run_id, r.step), heldout(ref, r.step)
        if mine is not None and theirs is not None:
            df.iat[i, df.columns.get_loc("kl_from_baseline")] = mean_kl(mine, theirs)
        sha = base_sha.get((r.study, r.seed, r.step))
        if sha is not None:
            df.iat[i, df.columns.get_loc("weights_identical")] = bool(sha == r.weights_sha1)
    return df


def summarize(df: pd.DataFrame, last: int = 4) -> pd.DataFrame:
    """One row per (study, setting): final reward and its paired difference from the baseline
    (mean and 95% half-width over seeds), seconds per step by phase, speedups, drafting counters,
    the final KL, and for exact methods whether every step's weights equal the baseline's."""
    if not isinstance(last, int) or last < 1:
        raise UserError(f"--last {last}: the final reward is the mean of the last N >= 1 steps")
    out = []
    for study, sdf in df.groupby("study", sort=True):
        final_step = int(sdf["step"].max())
        steps_total = sdf["step"].max() + 1
        window = sdf[sdf["step"] >= steps_total - last]
        grouped = window.groupby(["setting", "seed"])["reward_mean"]
        # only runs that have every step of the window: a run in flight counts in no final reward
        per_seed = grouped.mean()[grouped.size() == min(last, steps_total)]
        base_final = per_seed.get(BASELINE) if BASELINE in per_seed.index.get_level_values(0) else None
        times = sdf.groupby("setting")[["rollout_s", "train_s", "sync_s", "step_s"]].mean()
        for setting, g in sdf.groupby("setting", sort=True):
            # runs still short of the last steps (in flight) count in no final reward
            seeds = per_seed.loc[setting] if setting in per_seed.index.get_level_values(0) else pd.Series(dtype=float)
            reward, reward_ci = mean_ci95(seeds.to_numpy())
            diff, diff_ci = np.nan, np.nan
            if base_final is not None and setting != BASELINE:
                paired = [seeds[s] - base_final[s] for s in seeds.index if s in base_final.index]
                diff, diff_ci = mean_ci95(paired)
            last_rows = g[g["step"] == final_step]
            identical = g["weights_identical"].dropna()
            row = {"study": study, "setting": setting, "method": g["method"].iat[0], "rule": g["rule"].iat[0],
                   "lenience": g["lenience"].iat[0], "seeds": int(len(seeds)),
                   "steps": int(g.groupby("seed")["step"].count().min()),
                   "final_reward": reward, "final_reward_ci95": reward_ci,
                   "reward_diff_vs_baseline": diff, "reward_diff_ci95": diff_ci,
                   "kl_final": float(last_rows["kl_from_baseline"].mean()) if len(last_rows) else np.nan,
                   "weights_identical": (bool(identical.all()) if len(identical) else None),
                   # per rollout, as bench.report.stats' tokens_per_step: output tokens over the passes
                   # that rollout took part in (1.0 for the baseline)
                   "tokens_per_pass": g["output_tokens"].sum() / max(1, g["rollout_passes"].sum()),
                   "acceptance_rate": (g["num_accepted_tokens"].sum() / g["num_draft_tokens"].sum()
                                       if g["num_draft_tokens"].sum() else np.nan),
                   **{k: float(times.loc[setting, k]) for k in times.columns}}
            if BASELINE in times.index:
                row["rollout_speedup"] = float(times.loc[BASELINE, "rollout_s"] / times.loc[setting, "rollout_s"])
                row["step_speedup"] = float(times.loc[BASELINE, "step_s"] / times.loc[setting, "step_s"])
            out.append(row)
    return pd.DataFrame(out)


def per_step(df: pd.DataFrame) -> pd.DataFrame:
    """Per (study, setting, step): reward mean and 95% half-width over seeds, seconds, KL."""
    rows = []
    for (study, setting, step), g in df.groupby(["study", "setting", "step"], sort=True):
        reward, ci = mean_ci95(g["reward_mean"])
        rows.append({"study": study, "setting": setting, "step": int(step), "seeds": len(g),
                     "reward": reward, "reward_ci95": ci, "length_mean": g["length_mean"].mean(),
                     "rollout_s": g["rollout_s"].mean(), "train_s": g["train_s"].mean(),
                     "kl_from_baseline": g["kl_from_baseline"].mean()})
    return pd.DataFrame(rows)


def figure(steps: pd.DataFrame, study: str, path: Path) -> Path:
    """Reward against step per setting with its 95% band over seeds; rollout seconds beside."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report.plot_style import STYLE
    sdf = steps[steps["study"] == study]
    settings = sorted(sdf["setting"].unique(), key=lambda s: (s != BASELINE, s))
    palette = plt.get_cmap("tab10").colors
    with plt.rc_context(STYLE):
        fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
        for i, setting in enumerate(settings):
            g = sdf[sdf["setting"] == setting].sort_values("step")
            color = "0.3" if setting == BASELINE else palette[i % 10]
            # the baseline dashed and on top: an exact method's curve lies exactly under it
            base = setting == BASELINE
            ax_r.plot(g["step"], g["reward"], color=color, lw=1.6 if base else 1.3, ls="--" if base else "-",
                      zorder=5 if base else 3, label=f"{setting} ({int(g['seeds'].max())} seeds)")
            band = g["reward_ci95"].fillna(0)
            ax_r.fill_between(g["step"], g["reward"] - band, g["reward"] + band, color=color, alpha=0.15, lw=0)
            ax_t.plot(g["step"], g["rollout_s"], color=color, lw=1.3, ls="--" if base else "-", label=setting)
        ax_r.set(xlabel="GRPO step", ylabel="reward (mean over seeds, 95% band)", title="closed loop: reward")
        ax_t.set(xlabel="GRPO step", ylabel="rollout seconds per step (measured)", title="rollout time")
        ax_t.set_ylim(bottom=0)
        ax_r.legend(fontsize=8, loc="lower right")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        fig.savefig(path.with_suffix(".pdf"))
        plt.close(fig)
    return path


def write_report(root: Path, fig_root: Path, last: int = 4) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Summary and per-step tables as CSV and one figure per study under ``fig_root``."""
    df = load_runs(root)
    summary, steps = summarize(df, last), per_step(df)
    fig_root.mkdir(parents=True, exist_ok=True)
    summary.to_csv(fig_root / "closed_loop_summary.csv", index=False)
    steps.to_csv(fig_root / "closed_loop_per_step.csv", index=False)
    for study in summary["study"].unique():
        figure(steps, study, fig_root / f"closed_loop_{study}.png")
    return summary, steps


def report_text(summary: pd.DataFrame) -> str:
    """The summary as a markdown table per study (seconds measured here; intervals over seeds)."""
    blocks = []
    for study, s in summary.groupby("study", sort=True):
        s = s.assign(_order=s["setting"] != BASELINE).sort_values(["_order", "setting"]).drop(columns="_order")
        lines = [f"closed loop, study {study} ({int(s['steps'].max())} steps; final reward = mean of the last steps; "
                 f"+- = 95% half-width over seeds; diff paired by seed)",
                 "| setting | seeds | final reward | diff vs baseline | KL final | same weights | tokens/pass "
                 "| rollout s/step | train s/step | step s | rollout speedup | step speedup |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in s.itertuples():
            same = "" if r.weights_identical is None else ("yes" if r.weights_identical else "no")
            diff = "" if np.isnan(r.reward_diff_vs_baseline) else f"{r.reward_diff_vs_baseline:+.3f}{_pm(r.reward_diff_ci95)}"
            lines.append(f"| {r.setting} | {r.seeds} | {r.final_reward:.3f}{_pm(r.final_reward_ci95)} | {diff} | "
                         f"{r.kl_final:.2e} | {same} | {r.tokens_per_pass:.2f} | {r.rollout_s:.3f} | {r.train_s:.3f} | "
                         f"{r.step_s:.3f} | {getattr(r, 'rollout_speedup', np.nan):.2f} | "
                         f"{getattr(r, 'step_speedup', np.nan):.2f} |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _pm(half_width: float) -> str:
    return "" if np.isnan(half_width) else f" +- {half_width:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", type=Path, default=Path("results/train"))
    ap.add_argument("--out", type=Path, default=Path("results/figures/train"))
    ap.add_argument("--last", type=int, default=4, help="final reward = mean of the last N steps")
    args = ap.parse_args()
    summary, _ = write_report(args.root, args.out, args.last)
    print(report_text(summary))
    print(f"tables and figures in {args.out}")


if __name__ == "__main__":
    run_main(main)
