"""Speculation policies side by side: each method's speedup over the baseline under every policy.

    python -m bench.benchmarks policies [--steps 8] [--batch-sizes all,4] [--trace countdown] [--repeats-policies 1]
    python -m bench.benchmarks policies --trace countdown_search --batch-sizes all --repeats-policies 3   # the main job
    python -m bench.benchmarks policies --trace countdown_search --batch-sizes all --policies throughput_optimal --repeats-policies 6 --timing-repeats 3
    python -m bench.benchmarks policies --trace countdown_search --batch-sizes all --policies throughput_optimal --repeats-policies 6 --timing-repeats 3 --timing both

One run of the main job's exact methods per (policy, live-batch cap), each with its own baseline
in the same run (so every speedup is a ratio measured side by side), collected into one table.
``--repeats-policies N`` runs every configuration N times, the policies and the methods in a
rotated order each round (a slow spell of a shared machine then hits a different one each time),
and reports the median speedup and, from three repeats, its inter-quartile range. Every run also
replays the baseline a second time as ``baseline_again``: its speedup is the noise floor of the
same runs (``--no-control`` leaves it out). ``--policies`` picks some of the three.
``--timing-repeats R`` times every unit R times inside each run and keeps the median repeat.
``--timing interleaved`` runs each step's methods together, a few iterations of each in turn (the run's
``interleave=true``), so a drift of the machine's speed hits every method alike; ``--timing both``
runs every configuration both ways in each round, and the table sets the two side by side (the
spread of ``baseline_again`` under each is what each design leaves of the machine's noise).
``--interleave-turn K`` gives each call K iterations a turn (the run's ``interleave_turn``, default 4).
``throughput_optimal`` uses the engine's latency table of this machine (profiled once, cached).
``--trace-path DIR`` replays a trace folder instead of the named trace's cache.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
from tqdm import tqdm

POLICIES = (("fixed", []), ("batch_threshold", ["engine.spec_max_rows=32"]),
            ("throughput_optimal", ["engine.latency_table=auto"]))
METHODS = ("baseline", "prefix_reuse", "prefix_reuse_exact", "tree_cache", "tree_cache_tree", "tree_cache_runahead",
           "history_spec", "suffix_global", "hybrid", "das", "seer")  # the main job's
TIMINGS = ("sequential", "interleaved")  # the replay's interleave=false / true
CONTROL = "baseline_again"  # the baseline a second time, under another name: its speedup is the run's noise floor
CONTROL_OVERRIDE = (f"+method.{CONTROL}={{name:{CONTROL},drafter:{{_target_:methods.baseline.Baseline}},"
                    "verify:{rule:exact,lenience:1.0},run_ahead:false}")


def rotated(items: tuple, shift: int) -> list:
    """``items`` rotated left by ``shift``: each repeat starts the list at another place, so no
    policy (or method: the replay runs a step's methods in list order, itself rotated by step)
    always runs in the same position of a run."""
    shift %= max(len(items), 1)
    return list(items[shift:] + items[:shift])


def policy_speedups(steps: int | None = 8, batch_sizes=("all", "4"), methods=METHODS, trace: str = "countdown",
                    trace_path: str | None = None, repeats: int = 1, policies: tuple[str, ...] | None = None,
                    control: bool = True, timing_repeats: int = 1,
                    timings: tuple[str, ...] = ("sequential",), interleave_turn: int | None = None) -> list[dict]:
    """One row per (repeat, live-batch cap, policy, method): the speedup over the baseline of the
    same run. ``control`` adds ``baseline_again`` (an A/A pair: its spread over the repeats is
    what the machine's noise alone does to a speedup); ``timing_repeats`` is each run's (every
    unit timed that many times, in rounds of every method, the median kept: ``bench.harness.replay``);
    ``timings`` the timing designs, each a run per configuration (``TIMINGS``)."""
    from bench.report.collect import collect
    chosen = tuple(p for p in POLICIES if policies is None or p[0] in policies)
    if not chosen:
        raise ValueError(f"policies: none of {policies} is one of {[p for p, _ in POLICIES]}")
    bad = [t for t in timings if t not in TIMINGS]
    if bad or not timings:
        raise ValueError(f"policies: timing must be among {TIMINGS}, got {list(timings)}")
    configs = tuple((policy, extra, timing) for policy, extra in chosen for timing in timings)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in tqdm(range(repeats), desc="policies", unit="repeat"):
            for batch in batch_sizes:
                for policy, extra, timing in rotated(configs, rep):
                    root = Path(tmp) / f"{policy}-{timing}-{batch}-{rep}"
                    cmd = [sys.executable, "-m", "bench.harness.cli", f"trace={trace}",
                           f"method=[{','.join(rotated(tuple(methods), rep))}]",
                           f"engine.spec_policy={policy}", *extra, f"results_root={root}",
                           "plots=false", "progress=false", "predict=[]",
                           f"interleave={str(timing == 'interleaved').lower()}"]
                    if timing == "interleaved" and interleave_turn is not None:
                        cmd.append(f"interleave_turn={interleave_turn}")
                    if control:
                        cmd.append(CONTROL_OVERRIDE)
                    if steps:
                        cmd.append(f"max_steps={steps}")
                    if timing_repeats > 1:
                        cmd.append(f"timing_repeats={timing_repeats}")
                    if trace_path:
                        cmd.append(f"trace.path={trace_path}")
                    if batch != "all":
                        cmd.append(f"engine.max_batch_size={batch}")
                    done = subprocess.run(cmd, capture_output=True, text=True)
                    if done.returncode:
                        raise RuntimeError(f"policies: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
                    table = collect([root], progress=False).table
                    for r in table.itertuples():
                        rows.append({"live_rows": batch, "policy": policy, "timing": timing, "repeat": rep,
                                     "method": r.method,
                                     "tokens_per_step": r.tokens_per_step, "rollout_wall_s": r.rollout_wall_s,
                                     "speedup": r.speedup,
                                     "speedup_std": r.speedup_std, "identity_rate": r.identity_rate})
    return rows


def summary(rows: list[dict]) -> pd.DataFrame:
    """speedup by (live rows, method) x policy (x timing, where there were two): the median over
    repeats, and with more than two repeats its inter-quartile range beside it (``policy q25-q75``)."""
    frame = pd.DataFrame(rows)
    if "timing" in frame and frame["timing"].nunique() > 1:
        frame = frame.assign(policy=frame["policy"] + " " + frame["timing"])
    med = frame.pivot_table(index=["live_rows", "method"], columns="policy", values="speedup", aggfunc="median")
    if frame["repeat"].nunique() < 3:
        return med.round(3)
    q25 = frame.pivot_table(index=["live_rows", "method"], columns="policy", values="speedup",
                            aggfunc=lambda x: x.quantile(0.25))
    q75 = frame.pivot_table(index=["live_rows", "method"], columns="policy", values="speedup",
                            aggfunc=lambda x: x.quantile(0.75))
    out = pd.DataFrame(index=med.index)
    for policy in med.columns:
        out[policy] = med[policy].round(3)
        out[f"{policy} q25-q75"] = [f"{a:.3f}-{b:.3f}" for a, b in zip(q25[policy], q75[policy])]
    return out


def main(argv: list[str] | None = None) -> None:
    from bench.benchmarks.helpers import parser, print_rows
    ap = parser("policies", "each method's speedup over the baseline of the same run under every speculation policy")
    ap.add_argument("--trace", default="countdown", help="the trace to replay (a conf/trace name)")
    ap.add_argument("--trace-path", default=None, help="a trace folder to replay (trace.path)")
    ap.add_argument("--steps", type=int, default=8, help="steps to replay")
    ap.add_argument("--batch-sizes", default="all,4",
                    help="live-batch caps, comma-separated ('all' = the whole step at once)")
    ap.add_argument("--repeats-policies", type=int, default=1,
                    help="runs of every configuration, policies and methods rotated (median speedup)")
    ap.add_argument("--timing-repeats", type=int, default=1,
                    help="time every (step, method) this many times inside each run, methods interleaved, "
                         "and keep the median (the run's timing_repeats)")
    ap.add_argument("--policies", default=None,
                    help="only these (comma-separated: fixed, batch_threshold, throughput_optimal)")
    ap.add_argument("--timing", default="sequential", choices=["sequential", "interleaved", "both"],
                    help="time a step's methods one after the other, together a few iterations of each in "
                         "turn (the run's interleave=true), or both ways side by side")
    ap.add_argument("--interleave-turn", type=int, default=None,
                    help="--timing interleaved/both: iterations of a call a turn (the run's interleave_turn)")
    ap.add_argument("--no-control", action="store_true",
                    help="leave out baseline_again (the baseline a second time: the noise floor)")
    args = ap.parse_args(argv)
    rows = policy_speedups(steps=args.steps, trace=args.trace, batch_sizes=tuple(args.batch_sizes.split(",")),
                           trace_path=args.trace_path, repeats=args.repeats_policies, control=not args.no_control,
                           timing_repeats=args.timing_repeats,
                           timings=("sequential", "interleaved") if args.timing == "both" else (args.timing,),
                           interleave_turn=args.interleave_turn,
                           policies=None if args.policies is None else tuple(args.policies.split(",")))
    print_rows(rows)
    print("\nspeedup over the baseline of the same run, by policy:\n" + summary(rows).to_string())
