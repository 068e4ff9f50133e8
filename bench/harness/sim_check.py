"""Is the simulator the engine? Replays a trace through the CLI on torch_ref and simulates it with
``bench.harness.simulate``, then compares every rollout's counters and every pass of the iteration log.

    python -m bench.harness.sim_check --trace countdown_search --policy fixed            # the bundled trace
    python -m bench.harness.sim_check --trace countdown_tiny --policy batch_threshold --spec-max-rows 8
    python -m bench.harness.sim_check --trace countdown_search --policy throughput_optimal --table TABLE.csv

Both run the same scheduler (``bench.spec.scheduler``), so for exact methods under a policy that
reads no clock (``fixed``, ``batch_threshold``; ``throughput_optimal`` with ``--table``: the engine
runs with ``engine.seconds=table``, the simulator prices by the same table, so neither reads a
clock, ``bench.spec.prices``) they must agree exactly wherever the engine emitted
the recorded tokens (a baseline replay with the recorder's seed does; a float32 near-tie can flip
one, and the table says where). The printed table is what results/LOG.md records.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml

SHAPE = ["iteration", "call", "live_rows", "rows", "run_ahead_rows", "query_tokens", "block_tokens",
         "context_sum", "context_max", "draft_tokens", "draft_budget", "accepted_tokens"]
COUNTERS = ["output_len", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_forward_passes"]
KEY = ["step", "method", "prompt_id", "sample_idx"]
DEFAULT_METHODS = ("baseline", "prefix_reuse_exact", "tree_cache", "tree_cache_tree", "history_spec", "hybrid",
                   "das", "suffix_global", "seer")


def replay_with_cli(out: Path, trace: str, methods: list[str], policy: str, spec_max_rows: int,
                    dtype: str, extra: list[str] = ()) -> Path:
    """``python -m bench.harness.cli`` on torch_ref; returns its run folder."""
    args = [sys.executable, "-m", "bench.harness.cli", f"trace={trace}", f"method=[{','.join(methods)}]",
            f"engine.dtype={dtype}", f"engine.spec_policy={policy}", f"engine.spec_max_rows={spec_max_rows}",
            f"results_root={out / 'runs'}", f"figures_root={out / 'figs'}", "run_id=engine", "plots=false",
            "progress=false", "predict=[]", *extra]
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(f"bench.harness.cli failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return out / "runs" / "engine"


def simulate_like(run_dir: Path, out: Path, methods: list[str], policy: str, spec_max_rows: int,
                  table: str | None = None):
    """``python -m bench.harness.simulate`` on the run's trace and steps; (rollout rows, iteration rows)."""
    from bench.harness.simulate import main
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    steps = sorted(set(pd.read_parquet(run_dir / "steps.parquet")["step"]))
    argv = [config["trace"]["path"], *[a for m in methods for a in ("--method", m)], "--policy", policy,
            "--spec-max-rows", str(spec_max_rows), "--steps", ",".join(map(str, steps)),
            "--rollouts-out", str(out / "sim_rollouts.parquet"), "--iterations-out", str(out / "sim_iter.parquet")]
    main(argv + (["--table", table] if table else []))
    return pd.read_parquet(out / "sim_rollouts.parquet"), pd.read_parquet(out / "sim_iter.parquet")


def compare(run_dir: Path, sim_rows: pd.DataFrame, sim_iter: pd.DataFrame, priced: bool = False) -> pd.DataFrame:
    """One row per method: rollouts, how many equal in every counter, passes on each side, whether
    the iteration logs are equal pass for pass (``priced``: their forward seconds too), and the
    first differing pass."""
    from bench.report.results import load_iterations, load_run
    _, _, eng_rows, _ = load_run(run_dir)
    eng_iter = load_iterations(run_dir)
    both = eng_rows.merge(sim_rows, on=KEY, suffixes=("_eng", "_sim"))
    table = []
    for method, part in both.groupby("method", sort=False):
        same = pd.Series(True, index=part.index)
        for c in COUNTERS:
            same &= part[f"{c}_eng"] == part[f"{c}_sim"]
        per_pos = [list(a) == list(b) for a, b in zip(part["num_accepted_tokens_per_pos_eng"],
                                                      part["num_accepted_tokens_per_pos_sim"])]
        same &= pd.Series(per_pos, index=part.index)
        e = eng_iter[eng_iter["method"] == method].sort_values(["step", "iteration", "call"])
        s = sim_iter[sim_iter["method"] == method].sort_values(["step", "iteration", "call"])
        e_vals = e[["step", *SHAPE]].astype("int64").values.tolist()
        s_vals = s[["step", *SHAPE]].astype("int64").values.tolist()
        if priced:  # priced passes: the seconds too, to the bit
            e_vals = [v + [f] for v, f in zip(e_vals, e["forward_s"].tolist())]
            s_vals = [v + [f] for v, f in zip(s_vals, s["forward_s"].tolist())]
        first = next((i for i, (a, b) in enumerate(zip(e_vals, s_vals)) if a != b), None)
        if first is None and len(e_vals) != len(s_vals):
            first = min(len(e_vals), len(s_vals))
        table.append({"method": method, "rollouts": len(part),
                      "engine_emitted_recorded": int(part["matches_recorded"].fillna(False).astype(bool).sum()),
                      "counters_equal": int(same.sum()),
                      "passes_engine": len(e_vals), "passes_sim": len(s_vals),
                      "iteration_log_equal": first is None, "first_diff_pass": -1 if first is None else first})
    return pd.DataFrame(table)


def check(trace: str, methods: list[str], policy: str = "fixed", spec_max_rows: int = 32, dtype: str = "float32",
          out: Path | None = None, extra: list[str] = (), table: str | None = None) -> pd.DataFrame:
    """``table``: both sides priced by this latency table (needed for ``throughput_optimal``)."""
    if policy == "throughput_optimal" and not table:
        raise SystemExit("bench.harness.sim_check: --policy throughput_optimal compares priced runs: give --table CSV")
    if table:
        table = str(Path(table).resolve())
        extra = [*extra, f"engine.latency_table={table}", "engine.seconds=table"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(out or tmp)
        run_dir = replay_with_cli(out, trace, methods, policy, spec_max_rows, dtype, extra)
        sim_rows, sim_iter = simulate_like(run_dir, out, methods, policy, spec_max_rows, table)
        return compare(run_dir, sim_rows, sim_iter, priced=bool(table))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="countdown_search", help="a conf/trace name")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated exact methods")
    ap.add_argument("--policy", default="fixed", choices=("fixed", "batch_threshold", "throughput_optimal"))
    ap.add_argument("--table", help="a latency table CSV: the engine runs engine.seconds=table, the simulator "
                                    "prices by it (required by throughput_optimal)")
    ap.add_argument("--spec-max-rows", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, help="keep the run folder and the simulator's files here")
    ap.add_argument("extra", nargs="*", help="more bench.harness.cli overrides (e.g. engine.max_batch_size=16)")
    args = ap.parse_args(argv)
    table = check(args.trace, args.methods.split(","), args.policy, args.spec_max_rows, args.dtype, args.out,
                  args.extra, args.table)
    print(table.to_string(index=False))
    bad = table[(table.counters_equal < table.rollouts) | ~table.iteration_log_equal]
    if len(bad):
        sys.exit(f"simulator and engine differ for {list(bad.method)}")


if __name__ == "__main__":
    main()
