"""Learned drafters' training seconds beside the idle capacity a run's long tail leaves.

    python -m bench.benchmarks train-idle results/runs/RUN_ID

TLT trains its drafter on the GPUs the long tail leaves idle; whether a learned drafter's updates
fit there is the question. For each step of a run this prints the baseline's idle row-seconds:
every iteration's seconds times the share of the step's first batch no longer running
(1 - live rows / the most live rows of the step); and, per method that trains (its steps rows hold
``drafter_train_s``), the training seconds before that step, their ratio to the idle seconds, its
acceptance and whether the stale-drafter guard flagged it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from bench.report.results import load_iterations, load_run

SECONDS = ["forward_s", "verify_s", "drafter_s", "other_s"]


def idle_seconds(iterations: pd.DataFrame) -> pd.DataFrame:
    """Per (method, step): seconds of the step's iterations and their idle row-seconds share."""
    it = iterations.assign(seconds=iterations[SECONDS].sum(axis=1))
    first = it.groupby(["method", "step", "iteration"], as_index=False).agg(
        seconds=("seconds", "sum"), live=("live_rows", "first"))
    peak = first.groupby(["method", "step"])["live"].transform("max")
    first["idle_s"] = first["seconds"] * (1 - first["live"] / peak)
    return first.groupby(["method", "step"], as_index=False).agg(seconds=("seconds", "sum"), idle_s=("idle_s", "sum"))


def table(run_dir: Path, baseline: str = "baseline") -> pd.DataFrame:
    _, _, _, steps = load_run(run_dir)
    idle = idle_seconds(load_iterations(run_dir))
    base = idle[idle["method"] == baseline][["step", "seconds", "idle_s"]].rename(
        columns={"seconds": "baseline_s", "idle_s": "baseline_idle_s"})
    if "drafter_train_s" not in steps:
        return pd.DataFrame()
    learned = steps[steps["drafter_train_s"].notna()]
    cols = ["method", "step", "drafter_train_s", "drafter_acceptance", "drafter_stale", "drafter_parameters",
            "drafter_draft_vocab"]
    out = learned[[c for c in cols if c in learned]].merge(base, on="step", how="left")
    out["train_over_idle"] = out["drafter_train_s"] / out["baseline_idle_s"]
    return out.sort_values(["method", "step"]).reset_index(drop=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.benchmarks train-idle", description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a run folder (results/runs/RUN_ID) holding a baseline and learned drafters")
    ap.add_argument("--baseline", default="baseline")
    args = ap.parse_args(argv)
    out = table(args.run, args.baseline)
    if out.empty:
        print(f"{args.run}: no method of this run trains a drafter (no drafter_train_s column)")
        return
    print(out.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
