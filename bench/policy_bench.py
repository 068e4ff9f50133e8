"""Speculation policies side by side: each method's speedup over the baseline under every policy.

    python -m bench.benchmarks policies [--steps 8] [--batch-sizes all,4] [--trace countdown] [--repeats 1]
    python -m bench.benchmarks policies --trace countdown_search --batch-sizes all --repeats-policies 3   # the main job

One run of the main job's exact methods per (policy, live-batch cap), each with its own baseline
in the same run (so every speedup is a ratio measured side by side), collected into one table.
``--repeats N`` runs every configuration N times, the policies in a rotated order each round (a
slow spell of a shared machine then hits a different policy each time), and reports the median
speedup. ``throughput_optimal`` uses the engine's latency table of this machine (profiled once,
cached). ``--trace-path DIR`` replays a trace folder instead of the named trace's cache.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

POLICIES = (("fixed", []), ("batch_threshold", ["engine.spec_max_rows=32"]),
            ("throughput_optimal", ["engine.latency_table=auto"]))
METHODS = ("baseline", "prefix_reuse", "prefix_reuse_exact", "tree_cache", "tree_cache_tree", "tree_cache_runahead",
           "history_spec", "suffix_global", "hybrid", "das", "seer")  # the main job's


def policy_speedups(steps: int | None = 8, batch_sizes=("all", "4"), methods=METHODS, trace: str = "countdown",
                    trace_path: str | None = None, repeats: int = 1) -> list[dict]:
    from .collect import collect
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            for batch in batch_sizes:
                order = POLICIES[rep % len(POLICIES):] + POLICIES[:rep % len(POLICIES)]
                for policy, extra in order:
                    root = Path(tmp) / f"{policy}-{batch}-{rep}"
                    cmd = [sys.executable, "-m", "bench.cli", f"trace={trace}", f"method=[{','.join(methods)}]",
                           f"engine.spec_policy={policy}", *extra, f"results_root={root}",
                           "plots=false", "progress=false", "predict=[]"]
                    if steps:
                        cmd.append(f"max_steps={steps}")
                    if trace_path:
                        cmd.append(f"trace.path={trace_path}")
                    if batch != "all":
                        cmd.append(f"engine.max_batch_size={batch}")
                    subprocess.run(cmd, check=True, capture_output=True, text=True)
                    table = collect([root], progress=False).table
                    for r in table.itertuples():
                        rows.append({"live_rows": batch, "policy": policy, "repeat": rep, "method": r.method,
                                     "tokens_per_step": r.tokens_per_step, "speedup": r.speedup,
                                     "speedup_std": r.speedup_std, "identity_rate": r.identity_rate})
    return rows


def summary(rows: list[dict]) -> pd.DataFrame:
    """speedup by (live rows, method) x policy (the median over repeats)."""
    frame = pd.DataFrame(rows)
    return frame.pivot_table(index=["live_rows", "method"], columns="policy", values="speedup",
                             aggfunc="median").round(3)
