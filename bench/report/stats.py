"""The metric definitions of docs/results.md ("Derived metrics"), in one place (names follow vLLM's spec-decode counters).

    python -m bench.report.collect results/runs      # prints these metrics per engine and method

Hardware-independent metrics (counts and their ratios) come from rollouts.parquet; measured
times come from steps.parquet. Ratios are ratios of sums over the group (not means of per-rollout
ratios), and a zero denominator gives NaN. Run-ahead rollouts (generated only to feed drafter
caches) are excluded from every rollout metric.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from bench.spec.latency import TAIL_ROWS  # noqa: F401  (the tail's definition; re-exported for the reports)

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
RATIOS = ("mean_acceptance_length", "acceptance_rate", "tokens_per_step", "draft_contribution")
METRICS = ("num_rollouts", "output_tokens", "forward_passes", *COUNTERS, *RATIOS,
           "reward_mean", "num_steps", "rollout_wall_s", "rollout_wall_s_std", "tokens_per_s")


def safe_div(num, den) -> pd.Series:
    """num / den elementwise (index of ``num`` kept), NaN where den is 0 or missing."""
    num = pd.to_numeric(pd.Series(num), errors="coerce").astype(float)
    den = pd.to_numeric(pd.Series(den), errors="coerce").astype(float)
    return pd.Series(num.to_numpy() / den.where(den != 0).to_numpy(), index=num.index)


def add_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Add the ratio metrics to a frame holding summed counters, output_tokens, forward_passes."""
    df = df.copy()
    df["mean_acceptance_length"] = 1.0 + safe_div(df["num_accepted_tokens"], df["num_drafts"])
    df["acceptance_rate"] = safe_div(df["num_accepted_tokens"], df["num_draft_tokens"])
    df["tokens_per_step"] = safe_div(df["output_tokens"], df["forward_passes"])
    df["draft_contribution"] = safe_div(df["num_accepted_tokens"], df["output_tokens"])
    return df


def _trained(rollouts: pd.DataFrame) -> pd.DataFrame:
    if "run_ahead" in rollouts:
        return rollouts[~rollouts["run_ahead"].fillna(False).astype(bool)]
    return rollouts


def rollout_metrics(rollouts: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Counters, ratios and reward per group of rollouts.parquet rows."""
    r = _trained(rollouts).assign(
        output_tokens=lambda d: d["output_len"], forward_passes=lambda d: d["num_forward_passes"],
        reward=lambda d: pd.to_numeric(d["reward"], errors="coerce"))
    g = r.groupby(list(by), dropna=False, sort=True)
    out = g[["output_tokens", "forward_passes", *COUNTERS]].sum()
    out.insert(0, "num_rollouts", g.size())
    out["reward_mean"] = g["reward"].mean()
    return add_ratios(out).reset_index()


def step_metrics(steps: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Measured time per group of steps.parquet rows: mean and spread of wall seconds per step,
    tokens/s as total output tokens over total wall seconds."""
    g = steps.groupby(list(by), dropna=False, sort=True)
    out = pd.DataFrame({
        "num_steps": g.size(),
        "rollout_wall_s": g["wall_s"].mean(),
        "rollout_wall_s_std": g["wall_s"].std(ddof=0),
        "tokens_per_s": safe_div(g["output_tokens"].sum(), g["wall_s"].sum()),
    })
    return out.reset_index()


def summarize(rollouts: pd.DataFrame, steps: pd.DataFrame,
              by: Sequence[str] = ("run_id", "engine", "method"), per_step: bool = False) -> pd.DataFrame:
    """Every section-5 metric per group (``by`` plus ``step`` when ``per_step``)."""
    keys = [*by, "step"] if per_step and "step" not in by else list(by)
    left, right = rollout_metrics(rollouts, keys), step_metrics(steps, keys)
    out = left.merge(right, on=keys, how="outer")
    return out[keys + [m for m in METRICS if m in out]]


def accepted_lengths(per_pos: Iterable[int], num_drafts: int) -> np.ndarray:
    """Drafts by accepted length 0..K from vLLM-style per-position accepted counts.

    ``per_pos[k]`` counts drafts that had their depth-(k+1) token accepted; acceptance stops at
    the first rejection, so drafts accepting exactly k tokens = per_pos[k-1] - per_pos[k].
    Example: 5 drafts, per_pos [4, 2, 0] -> lengths 0: 1, 1: 2, 2: 2, 3: 0.
    """
    pos = np.asarray(list(per_pos), dtype=np.int64)
    ge = np.concatenate([[num_drafts], pos, [0]])  # drafts accepting >= k tokens, k = 0..K+1
    return ge[:-1] - ge[1:]


def accepted_length_hist(rollouts: pd.DataFrame, by: Sequence[str] = ("method",)) -> pd.DataFrame:
    """Long frame: ``by`` columns, accepted_length, drafts, fraction (of the group's drafts)."""
    rows = []
    for key, grp in _trained(rollouts).groupby(list(by), dropna=False, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        width = max((len(p) for p in grp["num_accepted_tokens_per_pos"]), default=0)
        total = np.zeros(width + 1, dtype=np.int64)
        for pos, n in zip(grp["num_accepted_tokens_per_pos"], grp["num_drafts"]):
            counts = accepted_lengths(pos, int(n))
            total[: len(counts)] += counts
        denom = total.sum()
        for length, drafts in enumerate(total):
            rows.append({**dict(zip(by, key)), "accepted_length": length, "drafts": int(drafts),
                         "fraction": drafts / denom if denom else np.nan})
    return pd.DataFrame(rows, columns=[*by, "accepted_length", "drafts", "fraction"])




def tail_share(iterations: pd.DataFrame, by: Sequence[str] = ("run_id", "method", "step"),
               max_rows: int = TAIL_ROWS) -> pd.DataFrame:
    """Per group (default: per step of a run's method): ``tail_share``, the share of rollout wall
    time spent in engine iterations with at most ``max_rows`` live rows, from iterations.parquet
    (one row per forward call; an iteration's seconds are its calls' forward + verify + drafter +
    other seconds; ``live_rows`` is the iteration's). Empty where no iterations were logged."""
    keys = list(by)
    if iterations is None or iterations.empty:
        return pd.DataFrame(columns=[*keys, "tail_share"])
    it = iterations.assign(seconds=iterations[["forward_s", "verify_s", "drafter_s", "other_s"]].fillna(0).sum(1))
    it = it.assign(tail_s=it["seconds"].where(it["live_rows"] <= max_rows, 0.0))
    g = it.groupby(keys, dropna=False, sort=True)[["tail_s", "seconds"]].sum()
    return g.assign(tail_share=safe_div(g["tail_s"], g["seconds"]))[["tail_share"]].reset_index()


# Two-sided 95% quantiles of Student's t by degrees of freedom (larger df: the next row down).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom (conservative
    between tabulated values; 1.96 past 120)."""
    if df < 1:
        return float("nan")
    below = [d for d in _T95 if d <= df]
    return _T95[max(below)] if df <= 120 else 1.960


def mean_ci95(values: Iterable[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t-interval) of independent values (seeds); NaN width for one."""
    x = np.asarray([v for v in values if v is not None and not np.isnan(v)], dtype=float)
    if len(x) == 0:
        return float("nan"), float("nan")
    if len(x) == 1:
        return float(x[0]), float("nan")
    return float(x.mean()), float(t95(len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
