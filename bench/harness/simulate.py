"""Offline replay of recorded rollouts through drafters, no model: acceptance numbers for traces and run logs.

    python -m bench.harness.simulate TRACE_OR_LOG_DIR --method tree_cache --method history_spec [--out FILE]
    python -m bench.harness.simulate TRACE_DIR --method tree_cache --method tree_cache:match=best   # a knob variant
    python -m bench.harness.simulate TRACE_DIR --method all --predict h200:llama-3.1-8b             # priced passes

The command line over the simulator's parts, each in its own module of ``bench.harness``:

- ``sim_inputs``: what it reads, a trace directory (its recorded rollouts and prompts) or a folder
  of run logs alone (one ``step_<N>.jsonl`` / ``.parquet`` file per step);
- ``sim_methods``: which methods can run (the lenient ``ratio`` rule and run-ahead are refused),
  their knob variants, and ``future_oracle``, which drafts each rollout's recorded future;
- ``sim_replay``: ``simulate``, each step's rollouts driven by the engine's own scheduler over the
  recorded tokens, so the counters and iteration log are a torch_ref replay's;
- ``sim_cache_oracle``: the bound beside every method (``cache_oracle_tokens_per_step``), the best
  any copying drafter could do with that method's cache contents and draft budget;
- ``sim_summary``: the metrics table. This module adds the predictions (``--predict``, ``--table``):
  the simulated schedule's passes priced per target, not measured.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import pandas as pd

from bench.harness.sim_inputs import checkpoint_steps, load_input
from bench.harness.sim_methods import SimulationError, check_simulable, expand_methods, method_config
from bench.harness.sim_replay import SIM_POLICIES, simulate
from bench.harness.sim_summary import summarize

SHOW = ["method", "num_rollouts", "output_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
        "mean_acceptance_length", "acceptance_rate", "tokens_per_step", "draft_contribution",
        "cache_oracle_tokens_per_step", "cache_oracle"]
LEGEND = ("future_oracle: drafts each rollout's recorded future (knows what will be sampled), the bound of "
          "any drafter. cache_oracle_tokens_per_step: the best any copying drafter could do with the same "
          "cache contents as that method (cache_oracle: whose rollouts, in flight or finished only) under "
          "that method's draft budget; a bound for that method.")



def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        run = _prepare(args)
    except SimulationError as exc:
        sys.exit(f"bench.harness.simulate: {exc}")
    steps = run.steps
    max_new = args.max_new_tokens or run.max_new or max(len(t) for df in steps.values() for t in df["token_ids"])
    n_rollouts = sum(len(df) for df in steps.values())
    n_tokens = sum(min(len(t), max_new) for df in steps.values() for t in df["token_ids"])
    print(f"{args.input}: {len(steps)} steps, {n_rollouts} rollouts, {n_tokens} tokens, "
          f"max_new_tokens {max_new} (loaded in {time.perf_counter() - t0:.1f}s)")
    t0 = time.perf_counter()
    rows = simulate(steps, run.prompts, run.cfgs, max_new, progress=True, policy=args.policy,
                    spec_max_rows=args.spec_max_rows, run_steps=run.run_steps, prices=run.prices, jobs=args.jobs)
    wall = time.perf_counter() - t0
    per_step = _print_tables(rows, args, run.targets, run.prices)
    print(textwrap.fill(LEGEND, 110))
    parts = ", ".join(f"{k} {v:.2f}s" for k, v in rows.attrs.get("timings", {}).items())
    print(f"simulated {len(run.cfgs)} methods in {wall:.1f}s ({parts})")
    if args.out:
        _write(per_step, args.out)
    if args.rollouts_out:
        _write(rows, args.rollouts_out)
    if args.iterations_out:
        _write(rows.attrs["iterations"], args.iterations_out)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input", type=Path, help="a trace directory or a folder of per-step rollout logs")
    ap.add_argument("--method", action="append", required=True,
                    help="a conf/method name, `future_oracle`, `all` (every simulable method) or `copying` (those "
                         "whose drafter runs no model: all but the learned drafters); repeatable; "
                         "NAME:knob=value,... overrides drafter knobs (e.g. tree_cache:match=best)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="draft budget cap (default: the trace's; for logs, the longest rollout)")
    ap.add_argument("--out", type=Path, help="write the per-step table (.csv or .parquet)")
    ap.add_argument("--rollouts-out", type=Path, help="write the per-rollout rows (.parquet)")
    ap.add_argument("--per-step", action="store_true", help="also print the per-step table")
    ap.add_argument("--policy", default="fixed", choices=SIM_POLICIES,
                    help="the engine's speculation policy (engine.spec_policy); throughput_optimal decides by the "
                         "one --table or --predict target given, every pass priced by it (engine.seconds=table)")
    ap.add_argument("--spec-max-rows", type=int, default=32,
                    help="batch_threshold: no drafts above this many live rows (engine.spec_max_rows)")
    ap.add_argument("--steps", default="all",
                    help="all (every recorded step), checkpoints (the steps a replay runs; the other steps "
                         "before them feed the drafters as finished rollouts, as the replay does) or a "
                         "comma-separated list")
    ap.add_argument("--iterations-out", type=Path, help="write the iteration log, one row per pass (.parquet)")
    ap.add_argument("--figures", type=Path, help="with --predict/--table: draw the predicted speedups and a step's "
                                                 "live rows over predicted time into this folder")
    ap.add_argument("--jobs", type=int, default=1, help="methods simulated in this many processes at once "
                                                       "(results identical to one process)")
    ap.add_argument("--predict", action="append", default=[], metavar="HARDWARE:MODEL",
                    help="price every pass through the roofline of conf/hardware x conf/model_shape, e.g. "
                         "h200:llama-3.1-8b (repeatable); adds the baseline if it is not simulated")
    ap.add_argument("--table", action="append", default=[], metavar="CSV",
                    help="price every pass through a latency table (python -m bench.benchmarks latency profile; repeatable)")
    return ap


class _SimulationInputs(NamedTuple):
    """The command's inputs, methods and price targets, all checked before anything is simulated."""

    steps: dict[int, pd.DataFrame]
    prompts: dict[str, list[int]]
    max_new: int | None  # the trace's max_new_tokens (None for logs)
    cfgs: dict[str, Any]
    targets: list[dict]
    run_steps: list[int] | None
    prices: Any


def _prepare(args: argparse.Namespace) -> _SimulationInputs:
    """Load the input and check every flag now, so a bad one is one clear error (``SimulationError``)."""
    steps, prompts, max_new = load_input(args.input)
    names = expand_methods(args.method)
    targets = _prediction_targets(args.predict, args.table)
    if targets and "baseline" not in names:
        names = ["baseline", *names]  # the speedups are against it
    cfgs = {n: method_config(n) for n in dict.fromkeys(names)}
    for n, c in cfgs.items():
        check_simulable(n, c)
    run_steps = _parse_steps(args.steps, args.input, steps)
    prices = _policy_prices(args.policy, targets)
    if args.jobs < 1:
        raise SimulationError(f"--jobs {args.jobs}: give a number of processes >= 1")
    if args.figures and not targets:
        raise SimulationError("--figures draws predictions: give --predict HARDWARE:MODEL or --table CSV")
    return _SimulationInputs(steps, prompts, max_new, cfgs, targets, run_steps, prices)


def _print_tables(rows: pd.DataFrame, args: argparse.Namespace, targets: list[dict], prices) -> pd.DataFrame:
    """Print the methods' table (and the predictions, the per-step table if asked); the per-step table."""
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 30)
    table = summarize(rows)
    print(table[SHOW].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    per_step = summarize(rows, per_step=True)
    if targets:
        per_step = _report_predictions(rows, per_step, targets, prices, args.figures)
    if args.per_step:
        print(per_step[["step", *SHOW]].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    return per_step


def _report_predictions(rows: pd.DataFrame, per_step: pd.DataFrame, targets: list[dict], prices,
                        figures: Path | None) -> pd.DataFrame:
    """Print the predictions (and draw them into ``figures``); the per-step table with their columns."""
    predicted = predictions(rows.attrs["iterations"], targets)
    _print_predictions(predicted)
    if prices is not None:
        print("(the policy's schedule was priced on a virtual clock: its drafter seconds are not timed, so these "
              "predictions are forward passes only)")
    per_step = per_step.merge(_wide(predicted), on=["method", "step"], how="left")
    if figures:
        from bench.report.sim_figures import write_figures
        paths = write_figures(rows.attrs["iterations"], predicted, targets, figures)
        print(f"{len(paths)} figures in {figures}")
    return per_step


def _prediction_targets(predict: list[str], tables: list[str]) -> list[dict]:
    """--predict HARDWARE:MODEL and --table CSV as targets, each checked now (one clear error)."""
    from bench.spec.latency import LatencyTable
    from bench.spec.roofline import Hardware, ModelShape
    out = []
    for item in predict:
        hw, sep, model = item.partition(":")
        if not sep or not hw or not model:
            raise SimulationError(f"--predict {item!r}: give HARDWARE:MODEL, e.g. h200:llama-3.1-8b "
                                  f"(names in conf/hardware and conf/model_shape)")
        try:
            out.append({"hardware": Hardware.named(hw), "model": ModelShape.named(model)})
        except Exception as exc:  # the roofline's own message names the choices
            raise SimulationError(f"--predict {item!r}: {exc}") from exc
    for path in tables:
        if not Path(path).is_file():
            raise SimulationError(f"--table {path}: no such file; write one with python -m bench.benchmarks latency profile")
        out.append({"table": LatencyTable.read(path)})
    return out


def _policy_prices(policy: str, targets: list[dict]):
    """throughput_optimal's prices: the one target's table or roofline (None for the other policies)."""
    if policy != "throughput_optimal":
        return None
    if len(targets) != 1:
        raise SimulationError(f"--policy throughput_optimal decides by one target's prices, got {len(targets)} "
                              f"(--table / --predict): run once per target")
    from bench.spec.prices import TablePrices
    target = targets[0]
    if "table" in target:
        return TablePrices(target["table"])
    from bench.spec.roofline import RooflineTable
    return TablePrices(RooflineTable(target["hardware"], target["model"]))


def predictions(iterations: pd.DataFrame, targets: list[dict]) -> pd.DataFrame:
    """Predicted seconds, speedup and tail share per (target, step, method) of a simulated
    schedule. A pass costs the target's forward seconds plus the drafter's seconds measured here
    (the simulator has no verifier, and its bookkeeping is not an engine's: neither is added)."""
    from bench.spec.latency import predict_iterations
    frames = [predict_iterations(iterations, t.get("table"), t.get("hardware"), t.get("model"),
                                 host_columns=("drafter_s",)) for t in targets]
    return pd.concat(frames, ignore_index=True)


def _wide(predicted: pd.DataFrame) -> pd.DataFrame:
    """One column per target and figure, e.g. ``predicted_speedup [roofline h200 x llama-3.1-8b]``."""
    cols = ["predicted_s", "predicted_speedup", "predicted_tail_share"]
    wide = predicted.pivot_table(index=["method", "step"], columns="target", values=cols)
    wide.columns = [f"{c} [{t}]" for c, t in wide.columns]
    return wide.reset_index()


def _print_predictions(predicted: pd.DataFrame) -> None:
    g = predicted.groupby(["target", "method"], as_index=False, sort=False)[
        ["predicted_s", "predicted_tail_share"]].mean()
    base = g[g["method"] == "baseline"].set_index("target")["predicted_s"]
    g["predicted_speedup"] = g["target"].map(base) / g["predicted_s"]
    g = g.rename(columns={"predicted_s": "predicted_s_per_step"})
    print("\nPredicted (not measured): the simulated schedule's passes priced per target, plus the drafter's "
          "seconds measured here")
    print(g.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    from bench.spec.latency import extrapolation_note
    note = extrapolation_note(predicted)
    if note:
        print(note)


def _parse_steps(value: str, path: Path, steps: Mapping[int, pd.DataFrame]) -> list[int] | None:
    if value == "all":
        return None
    if value == "checkpoints":
        found = checkpoint_steps(path)
        if found is None:
            raise SimulationError(f"--steps checkpoints needs a trace directory; {path} is a folder of logs")
        return found
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise SimulationError(f"--steps {value!r}: give all, checkpoints or a comma-separated list of step numbers "
                              f"(recorded: {sorted(steps)})") from None


def _write(df: pd.DataFrame, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    df = df.copy()
    df.attrs = {}  # timings and the iteration log travel beside the rows, not in the file's metadata
    if path.suffix == ".csv":
        df.to_csv(path, index=False)
    else:
        df.to_parquet(path, index=False)
    print(f"wrote {path}")



if __name__ == "__main__":
    from bench.core.errors import run_main
    run_main(main)
