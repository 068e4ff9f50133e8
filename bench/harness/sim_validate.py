"""Does the simulator predict this machine? A torch_ref run's measured speedups against the
simulator's schedule of the same steps, priced by a latency table profiled here.

    python -m bench.benchmarks latency profile --out results/latency/here.csv
    python -m bench.harness.cli interleave=true run_id=val predict=[] plots=false     # measured, interleaved
    python -m bench.harness.sim_validate results/runs/val --table results/latency/here.csv

The simulated schedule is the engine's (``bench.harness.sim_check``), so what is validated here is the
price of it. A simulated iteration costs the table's seconds for each pass, the drafter's seconds
measured in the simulation (the same drafter code, on this machine), and the engine's host
seconds (verifier and bookkeeping), which the simulator does not run: modelled as a + b x live
rows, fitted on the run's *baseline* iterations, plus c x accepted tokens, the verifier timed alone
here (``verify_per_token``); never fitted on the methods it predicts. The table's level is taken from
the baseline too (``table_level``): a profile times each shape in a tight loop, while a run's passes
follow drafter and verifier work that leaves the caches cold, so every pass of a run measures about
the same factor dearer (1.5-1.7x on the search model here, results/LOG.md); ``--no-level`` prices
through the table as profiled. Prints, per method, the median over steps of |predicted - measured| /
measured speedup; exit status 1 above ``--tolerance``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from bench.core.errors import UserError, run_main


def host_model(iterations: pd.DataFrame) -> tuple[float, float]:
    """(a, b): the engine's verifier and bookkeeping seconds of an iteration as a + b x live rows,
    least squares over the baseline's decoding iterations (its first pass of a call, the prefill,
    left out)."""
    base = iterations[(iterations["method"] == "baseline") & (iterations["iteration"] > 0)]
    per = base.groupby(["step", "iteration"]).agg(rows=("live_rows", "first"), verify_s=("verify_s", "sum"),
                                                  other_s=("other_s", "sum"))
    if len(per) < 3:
        raise UserError("the run's baseline logged fewer than 3 decoding iterations: too few to fit host seconds")
    b, a = np.polyfit(per["rows"].to_numpy(float), (per["verify_s"] + per["other_s"]).to_numpy(), 1)
    return max(float(a), 0.0), max(float(b), 0.0)


def table_level(iterations: pd.DataFrame, table) -> float:
    """The run's baseline forward seconds over the table's price of the same passes: the factor by
    which this run's passes were dearer than the profile's (the baseline's passes only)."""
    from bench.spec.latency import pass_seconds
    base = iterations[iterations["method"] == "baseline"]
    if base.empty:
        raise UserError("the run's baseline logged no passes: the table's level needs them")
    priced, _ = pass_seconds(base, table)
    return float(base["forward_s"].sum() / priced.sum())


def verify_per_token(vocab: int, sampling=None, tokens: int = 64, repeats: int = 20) -> float:
    """Seconds the verifier spends per accepted draft token beyond a plain row, timed here on random
    logits of the model's vocabulary under the run's sampling and the exact rule, with a draft it
    accepts whole (the verifier reads a chain's nodes until its first rejection, so its cost follows
    the accepted tokens): the draft is the coupled samples themselves, found one verification at a time."""
    import time
    from dataclasses import replace

    import torch

    from methods.base import Draft

    from bench.core.sampling import SamplingConfig
    from bench.core.verify import VerifyConfig, verify_nodes
    sampling = replace(sampling or SamplingConfig(), max_new_tokens=tokens + 1)
    keys = torch.zeros(1, dtype=torch.int64)
    logits = torch.randn(1, tokens + 1, vocab)

    def verify(draft: list[int]):
        return verify_nodes(lambda b, j: logits[b, j], vocab, [Draft(token_ids=draft)], keys, [0], sampling,
                            VerifyConfig())[0]
    draft: list[int] = []
    for _ in range(tokens):  # every node accepted: the next token is the one the rule samples there
        draft.append(verify(draft).emitted[-1])

    def run(k: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            verify(draft[:k])
            best = min(best, time.perf_counter() - t0)
        return best
    return max(run(tokens) - run(0), 0.0) / tokens


def validate(run_dir: Path, table_path: Path, jobs: int = 1, level: bool = True) -> pd.DataFrame:
    """Per (step, method): measured and predicted speedup and the relative error."""
    from bench.spec.latency import LatencyTable, predict_iterations
    from bench.report.results import load_iterations, load_run
    from bench.harness.sim_inputs import load_input
    from bench.harness.sim_replay import simulate
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    _, _, _, steps = load_run(run_dir)
    eng_it = load_iterations(run_dir)
    table = LatencyTable.read(table_path)
    scale = table_level(eng_it, table) if level else 1.0
    table = table.scaled(scale)
    from omegaconf import OmegaConf

    from bench.harness.sim_methods import SimulationError, check_simulable
    engine = config["engine"]
    policy = engine.get("spec_policy", "fixed")
    if engine.get("name") != "torch_ref" or engine.get("max_batch_size") is not None:
        raise UserError(f"{run_dir}: the simulator mirrors torch_ref with the whole step live (max_batch_size "
                        f"null); this run has engine {engine.get('name')}, max_batch_size {engine.get('max_batch_size')}")
    if policy == "throughput_optimal":
        raise UserError(f"{run_dir}: throughput_optimal read this run's clock, which the simulator cannot replay; "
                        f"validate a fixed or batch_threshold run")
    cfgs, skipped = {}, []
    for m in dict.fromkeys(steps["method"]):  # the run's own method configs, its knobs included
        cfg = OmegaConf.create(config["method"][m])
        try:
            check_simulable(m, cfg)
            cfgs[m] = cfg
        except SimulationError:  # the lossy rule and run-ahead cannot be simulated
            skipped.append(m)
    if "baseline" not in cfgs:
        raise UserError(f"{run_dir}: no baseline in this run: speedups need one")
    methods = list(cfgs)
    recorded, prompts, max_new = load_input(config["trace"]["path"])
    max_new = config["sampling"]["max_new_tokens"]
    rows = simulate(recorded, prompts, cfgs, max_new, policy=policy, spec_max_rows=int(engine.get("spec_max_rows", 32)),
                    run_steps=sorted(set(steps["step"])), jobs=jobs)
    it = rows.attrs["iterations"]
    a, b = host_model(eng_it)
    from bench.core.sampling import SamplingConfig
    per_token = verify_per_token(_vocab(config), SamplingConfig(**{k: v for k, v in config["sampling"].items()
                                                                   if k != "n"}))
    it = it.assign(host_model_s=np.where(it["call"] == 0, a + b * it["live_rows"], 0.0)
                   + per_token * it["accepted_tokens"])
    pred = predict_iterations(it, table, host_columns=("drafter_s", "host_model_s"))
    meas = steps[steps["method"].isin(methods)][["step", "method", "wall_s"]]
    out = pred.merge(meas, on=["step", "method"])
    base = out[out["method"] == "baseline"].set_index("step")["wall_s"]
    out["measured_speedup"] = out["step"].map(base) / out["wall_s"]
    out["error"] = (out["predicted_speedup"] - out["measured_speedup"]).abs() / out["measured_speedup"]
    out.attrs.update(host_a=a, host_b=b, verify_per_token=per_token, skipped=skipped, table_level=scale)
    return out


def _vocab(config: dict) -> int:
    from bench.traces.format import Trace
    trace = Trace.load(config["trace"]["path"])
    ckpt = trace.checkpoint(trace.step_numbers[-1])
    return int(yaml.safe_load(Path(ckpt, "config.json").read_text())["vocab_size"])


def summary(per_step: pd.DataFrame) -> pd.DataFrame:
    g = per_step.groupby("method", sort=False).agg(steps=("step", "count"), measured_speedup=("measured_speedup", "median"),
                                                    predicted_speedup=("predicted_speedup", "median"),
                                                    median_error=("error", "median"), max_error=("error", "max"))
    return g.reset_index()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a torch_ref run folder with a baseline (python -m bench.harness.cli ...)")
    ap.add_argument("--table", type=Path, required=True, help="a latency table of this machine and model")
    ap.add_argument("--tolerance", type=float, default=0.10, help="largest median error accepted (default 0.10)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--level", action=argparse.BooleanOptionalAction, default=True,
                    help="level the table by the baseline's measured passes (default; --no-level: as profiled)")
    ap.add_argument("--out", type=Path, help="write the per-step table (.csv)")
    args = ap.parse_args(argv)

    def go() -> None:
        if not (args.run / "config.yaml").is_file():
            raise UserError(f"{args.run}: not a run folder (no config.yaml); run python -m bench.harness.cli first")
        per = validate(args.run, args.table, args.jobs, args.level)
        table = summary(per)
        print(f"host model from the baseline: {per.attrs['host_a'] * 1e3:.3f} ms + {per.attrs['host_b'] * 1e6:.2f} us"
              f" x live rows an iteration; verifier {per.attrs['verify_per_token'] * 1e6:.2f} us an accepted token;"
              f" the table's passes x {per.attrs['table_level']:.3f} (the baseline's measured over profiled)")
        print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        if per.attrs["skipped"]:
            print(f"not simulable, left out: {', '.join(per.attrs['skipped'])} (the lossy rule, run-ahead)")
        from bench.spec.latency import extrapolation_note
        note = extrapolation_note(per)
        if note:
            print(note)
        if args.out:
            per.to_csv(args.out, index=False)
        worst = table[table["method"] != "baseline"]["median_error"].max()
        if worst > args.tolerance:
            sys.exit(f"median error up to {worst:.3f} > tolerance {args.tolerance}")
    run_main(go)


if __name__ == "__main__":
    main()
