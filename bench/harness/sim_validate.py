"""Does the simulator predict this machine? A torch_ref run's measured speedups against the
simulator's schedule of the same steps, priced by a latency table profiled here.

    python -m bench.benchmarks latency profile --out results/latency/here.csv
    python -m bench.harness.cli interleave=true run_id=val predict=[] plots=false     # measured, interleaved
    python -m bench.harness.sim_validate results/runs/val --table results/latency/here.csv

The simulated schedule is the engine's (``bench.harness.sim_check``), so what is validated here is the
price of it: each method is simulated over the tokens it emitted in the run (``--tokens run``,
``run_tokens``), which are the trace's except where a float32 run on another CPU parted from them at
a near-tie. A simulated iteration costs the table's seconds for each pass, the drafter's seconds
measured in the simulation (the same drafter code, on this machine), and the engine's host
seconds (verifier and bookkeeping), which the simulator does not run: ``HostModel``, its
intercepts and slopes fitted on the run's *baseline* iterations, its price of each further node
the verifier reads (the simulated passes count them: ``nodes_read``) and of each accepted token
the verifier timed alone here (``verifier_costs``); never fitted on the methods it predicts. The
table's level is taken from the baseline too (``table_level``): a profile times each shape in a
tight loop, while a run's passes follow drafter and verifier work that leaves the caches cold, so
every pass of a run measures about the same factor dearer (1.5-1.7x on the search model here,
results/LOG.md); so is the drafters' (``drafter_level``: the simulator runs them in a tight loop
too, 2-3x cheaper there). ``--no-level`` prices as timed. Prints, per method, the median over
steps of |predicted - measured| / measured speedup; exit status 1 above ``--tolerance``.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from bench.core.errors import UserError, run_main


@dataclass(frozen=True)
class HostModel:
    """The engine's host seconds (verifier and bookkeeping), which the simulator does not run.

    A pass's verifier: ``verify_a + verify_b x rows`` (one call, one plain read a row), then
    ``per_node`` for every further node it reads (``nodes_read``: the windows' nodes, rejected
    ones too) and ``per_accepted`` for every accepted token (the descent, the verdict). The rest
    of an iteration: ``other_a + other_b x live rows``. The four intercepts and slopes are fitted
    on the run's baseline (one pass an iteration, one read a row); the per-node and per-token
    prices are the verifier timed alone here (``verifier_costs``)."""

    verify_a: float
    verify_b: float
    other_a: float
    other_b: float
    per_node: float = 0.0
    per_accepted: float = 0.0

    def seconds(self, it: pd.DataFrame) -> np.ndarray:
        """Host seconds of each logged pass (the rest of its iteration on its first)."""
        rows = it["rows"].to_numpy(float)
        read = it["nodes_read"].fillna(it["rows"]) if "nodes_read" in it else it["rows"]  # older logs: none
        extra = np.maximum(read.to_numpy(float) - rows, 0.0)
        first = it["call"].to_numpy() == 0
        return (self.verify_a + self.verify_b * rows + self.per_node * extra
                + self.per_accepted * it["accepted_tokens"].to_numpy(float)
                + np.where(first, self.other_a + self.other_b * it["live_rows"].to_numpy(float), 0.0))


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    b, a = np.polyfit(x.astype(float), y, 1)
    return max(float(a), 0.0), max(float(b), 0.0)


def host_model(iterations: pd.DataFrame) -> HostModel:
    """The baseline's part of :class:`HostModel`, least squares over its decoding iterations (its
    first pass of a call, the prefill, left out): verify_s on the pass's rows, other_s on the
    iteration's live rows."""
    base = iterations[(iterations["method"] == "baseline") & (iterations["iteration"] > 0)]
    if base[["step", "iteration"]].drop_duplicates().shape[0] < 3:
        raise UserError("the run's baseline logged fewer than 3 decoding iterations: too few to fit host seconds")
    verify_a, verify_b = _line(base["rows"].to_numpy(), base["verify_s"].to_numpy())
    first = base[base["call"] == 0]
    other_a, other_b = _line(first["live_rows"].to_numpy(), first["other_s"].to_numpy())
    return HostModel(verify_a, verify_b, other_a, other_b)


def table_level(iterations: pd.DataFrame, table) -> float:
    """The run's baseline forward seconds over the table's price of the same passes: the factor by
    which this run's passes were dearer than the profile's (the baseline's passes only)."""
    from bench.spec.latency import pass_seconds
    base = iterations[iterations["method"] == "baseline"]
    if base.empty:
        raise UserError("the run's baseline logged no passes: the table's level needs them")
    priced, _ = pass_seconds(base, table)
    return float(base["forward_s"].sum() / priced.sum())


def drafter_level(engine_it: pd.DataFrame, simulated_it: pd.DataFrame) -> dict[int, float]:
    """Per step, the baseline's drafter seconds in the run over the same drafter's in the
    simulation: the factor by which the drafter code's host work ran dearer between the engine's
    passes (caches cold, other methods interleaved) than in the simulator's tight loop. The
    baseline's (a null drafter's bookkeeping) only; 1.0 where a step's simulation timed none."""
    def per_step(it: pd.DataFrame) -> pd.Series:
        return it[it["method"] == "baseline"].groupby("step")["drafter_s"].sum()
    run, sim = per_step(engine_it), per_step(simulated_it)
    return {int(k): float(run[k] / sim[k]) if sim.get(k, 0) > 0 and k in run else 1.0 for k in sim.index}


def verifier_costs(vocab: int, sampling=None, tokens: int | None = None, rows: int = 4,
                   repeats: int = 50) -> tuple[float, float]:
    """(per node read, per accepted token): the verifier's seconds beyond a plain row, timed here on
    random logits of the model's vocabulary under the run's sampling and the exact rule. A batch of
    ``rows`` rows, each with a draft of ``tokens`` tokens (default: one window less its root, every
    node read at once), against the same rows undrafted: rejected at the first node (the reads
    alone) and accepted whole (the reads and the descent); the accepted drafts are the coupled
    samples themselves, found one verification at a time. Fastest of ``repeats``."""
    import time

    import torch

    from methods.base import Draft

    from bench.core.sampling import SamplingConfig
    from bench.core.verify import WINDOW, VerifyConfig, verify_nodes
    tokens = WINDOW - 1 if tokens is None else tokens
    sampling = replace(sampling or SamplingConfig(), max_new_tokens=tokens + 1)
    keys = torch.arange(rows, dtype=torch.int64)
    logits = torch.randn(rows, tokens + 1, vocab)

    def verify(drafts: list[list[int]]):
        return verify_nodes(lambda b, j: logits[b, j], vocab, [Draft(token_ids=d) for d in drafts], keys,
                            [0] * rows, sampling, VerifyConfig())
    accepted: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(tokens):  # every node accepted: the next token is the one the rule samples there
        for d, v in zip(accepted, verify(accepted)):
            d.append(v.emitted[-1])
    rejected = [[(d[0] + 1) % vocab] + d[1:] for d in accepted]

    def best(drafts: list[list[int]]) -> float:
        out = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            verify(drafts)
            out = min(out, time.perf_counter() - t0)
        return out
    plain, reads, whole = best([[] for _ in range(rows)]), best(rejected), best(accepted)
    n = tokens * rows
    return max(reads - plain, 0.0) / n, max(whole - reads, 0.0) / n


def run_tokens(recorded: dict[int, pd.DataFrame], run_rows: pd.DataFrame, method: str) -> dict[int, pd.DataFrame]:
    """The trace's rollouts with the steps ``method`` ran replaced by what it emitted there (its trained
    rollouts, in the trace's row order): a float32 run parts from the recording at near-ties on
    another CPU than the recording's, and one rollout that then runs to the length cap sets a
    step's tail, so the schedule to price is the one of the tokens the run emitted."""
    mine = run_rows[(run_rows["method"] == method) & ~run_rows["run_ahead"].astype(bool)]
    out = dict(recorded)
    for step, part in mine.groupby("step"):
        by_key = part.set_index(["prompt_id", "sample_idx"])
        df = recorded[int(step)]
        keys = list(zip(df["prompt_id"].astype(str), df["sample_idx"].astype(int)))
        missing = [k for k in keys if k not in by_key.index]
        if missing:
            raise UserError(f"the run has no {method} rollout {missing[0]} of step {step}: validate a complete run")
        got = by_key.loc[keys]
        out[int(step)] = df.assign(token_ids=[list(t) for t in got["output_tokens"]],
                                   logprobs=[list(x) for x in got["logprobs"]],
                                   finish_reason=list(got["finish_reason"].astype(str)))
    return out


def validate(run_dir: Path, table_path: Path, jobs: int = 1, level: bool = True, tokens: str = "run") -> pd.DataFrame:
    """Per (step, method): measured and predicted speedup and the relative error. ``tokens``: ``run``
    simulates each method over the tokens it emitted in the run (``run_tokens``), ``trace`` all of
    them over the trace's recorded ones."""
    if tokens not in ("run", "trace"):
        raise UserError(f"tokens={tokens!r}: choose run (each method's emitted tokens) or trace (the recorded ones)")
    from bench.spec.latency import LatencyTable, predict_iterations
    from bench.report.results import load_iterations, load_run
    from bench.harness.sim_inputs import load_input
    from bench.harness.sim_replay import simulate
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    _, _, run_rows, steps = load_run(run_dir)
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
    knobs = dict(policy=policy, spec_max_rows=int(engine.get("spec_max_rows", 32)), run_steps=sorted(set(steps["step"])))
    if tokens == "trace":
        it = simulate(recorded, prompts, cfgs, max_new, jobs=jobs, **knobs).attrs["iterations"]
    else:  # one simulation a method, over its own tokens
        it = pd.concat([simulate(run_tokens(recorded, run_rows, m), prompts, {m: cfgs[m]}, max_new, **knobs)
                        .attrs["iterations"] for m in methods], ignore_index=True)
    from bench.core.sampling import SamplingConfig
    per_node, per_accepted = verifier_costs(_vocab(config), SamplingConfig(**{k: v for k, v in config["sampling"].items()
                                                                              if k != "n"}))
    host = replace(host_model(eng_it), per_node=per_node, per_accepted=per_accepted)
    drafter = drafter_level(eng_it, it) if level else {}
    it = it.assign(host_model_s=host.seconds(it),
                   drafter_levelled_s=it["drafter_s"].fillna(0.0) * it["step"].map(drafter).fillna(1.0))
    pred = predict_iterations(it, table, host_columns=("drafter_levelled_s", "host_model_s"))
    meas = steps[steps["method"].isin(methods)][["step", "method", "wall_s"]]
    out = pred.merge(meas, on=["step", "method"])
    base = out[out["method"] == "baseline"].set_index("step")["wall_s"]
    out["measured_speedup"] = out["step"].map(base) / out["wall_s"]
    out["error"] = (out["predicted_speedup"] - out["measured_speedup"]).abs() / out["measured_speedup"]
    out.attrs.update(host=host, skipped=skipped, table_level=scale, drafter_level=drafter)
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
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes for --tokens trace, methods spread over them (--tokens run: one simulation a "
                         "method, in turn; seconds for a real-model run)")
    ap.add_argument("--level", action=argparse.BooleanOptionalAction, default=True,
                    help="level the table and the drafters' seconds by the baseline's (default; --no-level: as timed)")
    ap.add_argument("--tokens", choices=("run", "trace"), default="run",
                    help="simulate each method over the tokens it emitted in the run (default), or every method over "
                         "the trace's recorded tokens (equal where the run is on the recording's CPU and dtype)")
    ap.add_argument("--out", type=Path, help="write the per-step table (.csv)")
    args = ap.parse_args(argv)

    def go() -> None:
        if not (args.run / "config.yaml").is_file():
            raise UserError(f"{args.run}: not a run folder (no config.yaml); run python -m bench.harness.cli first")
        per = validate(args.run, args.table, args.jobs, args.level, args.tokens)
        table = summary(per)
        h = per.attrs["host"]
        print(f"host model from the baseline: verifier {h.verify_a * 1e3:.3f} ms + {h.verify_b * 1e6:.2f} us x rows a"
              f" pass, the rest {h.other_a * 1e3:.3f} ms + {h.other_b * 1e6:.2f} us x live rows an iteration; timed"
              f" here: {h.per_node * 1e6:.2f} us a further node read, {h.per_accepted * 1e6:.2f} us an accepted token;"
              f" the table's passes x {per.attrs['table_level']:.3f} (the baseline's measured over profiled)")
        if per.attrs["drafter_level"]:
            print("the simulated drafters' seconds x " + ", ".join(f"{v:.2f} (step {k})" for k, v in
                                                                 per.attrs["drafter_level"].items())
                  + " (the baseline's drafter in the run over in the simulation)")
        print("simulated over " + ("each method's tokens as the run emitted them" if args.tokens == "run" else
                                   "the trace's recorded tokens, every method alike") + f" (--tokens {args.tokens})")
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
