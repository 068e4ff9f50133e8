"""The simulator's table: section-5 metrics per method (and step) of its per-rollout rows, beside
each method's cache oracle.

    python -m bench.harness.simulate TRACE_DIR --method tree_cache [--per-step]   # prints these tables

The metrics are ``bench.report.stats``' own (the rows carry the engine's counters); this module
adds the cache oracle's ``cache_oracle_tokens_per_step`` (``bench.harness.sim_cache_oracle``).
"""
from __future__ import annotations

import pandas as pd

from bench.report.stats import rollout_metrics, safe_div


def summarize(rows: pd.DataFrame, per_step: bool = False) -> pd.DataFrame:
    """Section-5 metrics per method (and step), via ``bench.report.stats``, plus the cache oracle's
    ``cache_oracle_tokens_per_step`` under the bound named in ``cache_oracle`` (NaN and blank for
    the future oracle, which no cache bounds)."""
    by = ["method", "step"] if per_step else ["method"]
    out = rollout_metrics(rows, by)
    g = rows.groupby(by, dropna=False, sort=True)
    per_pos = g["num_accepted_tokens_per_pos"].agg(_sum_lists).reset_index()
    oracle = g[["output_len", "cache_oracle_num_forward_passes"]].sum().reset_index()
    oracle["cache_oracle_tokens_per_step"] = safe_div(oracle["output_len"],
                                                      oracle["cache_oracle_num_forward_passes"])
    oracle["cache_oracle"] = g["cache_oracle"].first().to_numpy()
    out = out.merge(per_pos, on=by).merge(oracle[by + ["cache_oracle_tokens_per_step", "cache_oracle"]], on=by)
    order = {m: i for i, m in enumerate(dict.fromkeys(rows["method"]))}  # the order methods were given
    return out.sort_values(by, key=lambda s: s.map(order) if s.name == "method" else s).reset_index(drop=True)


def _sum_lists(lists) -> list[int]:
    total: list[int] = []
    for xs in lists:
        xs = list(xs)
        if len(total) < len(xs):
            total += [0] * (len(xs) - len(total))
        for i, x in enumerate(xs):
            total[i] += int(x)
    return total
