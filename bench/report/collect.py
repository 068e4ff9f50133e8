"""Merge run folders (local, swept, copied from other machines) and compare methods to the baseline.

    python -m bench.report.collect results/runs [more run folders or roots ...] [--out results/tables]

Speedup and reward delta are computed here only, against the baseline run of the SAME setup, over
the steps both runs have. The setup is the trace name, the engine name, every key of the engine
section of config.yaml (device, dtype, batch size, threads, engine knobs), the hardware of
summary.json (``HARDWARE_KEYS``: CPU model, core count, GPU model, GPU count; the platform string,
versions and git sha are not part of it: they change with a kernel or package update, not with the
machine) and the sampling (``sampling.temperature/top_p/top_k/max_new_tokens/seed``). A method is
paired with the baseline of its own run when that run has one, else with the one baseline run of
the same setup; where there is none, or several, speedup, reward delta and identity are NaN and a
note says why (nothing is picked at random).

Identity (exact methods only, on a coupled engine such as ``torch_ref``): ``identity_rate`` is the
share of (step, prompt, sample) slots whose tokens equal the paired baseline's, and
``rule_divergences`` counts the divergences that are not near-ties of the engine dtype
(``bench.core.precision``); for an exact method it must be 0. Both are blank for the baseline, lossy
methods (verify rule ``ratio``) and engines whose sampling is not coupled.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from bench.report.results import STEPS_DIR, RunFolderError, _flatten, load_run
from bench.report.stats import summarize, tail_share

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "seed")
HARDWARE_KEYS = ("cpu", "cores", "gpu", "gpu_count")  # summary.json hardware fields that name the machine
# what must match for a baseline to count (engine_config: the engine section; see the docstring)
GROUP = ("trace", "engine", "engine_config", "hardware", "sampling")
COUPLED_ENGINES = ("torch_ref",)  # engines whose sampling is coupled: exact methods are token-identical
DISPLAY = ("method", "tokens_per_step", "mean_acceptance_length", "acceptance_rate",
           "rollout_wall_s", "tokens_per_s", "speedup", "speedup_std", "reward_delta",
           "identity_rate", "rule_divergences", "tail_share", "num_steps")


@dataclass
class Collection:
    runs: pd.DataFrame       # one row per run folder
    rollouts: pd.DataFrame   # rows of the runs used, ``method`` relabelled with knob variants
    steps: pd.DataFrame
    table: pd.DataFrame      # one row per (GROUP..., method): trace, engine, its settings, hardware, sampling
    per_step: pd.DataFrame   # the same per step, with per-step speedup
    notes: list[str] = field(default_factory=list)


def sampling_label(config: dict) -> str:
    s = config.get("sampling") or {}
    fmt = lambda v: "?" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
    return " ".join(f"{k}={fmt(s.get(k))}" for k in SAMPLING_KEYS)


def _named(section):
    """A config section's name: ``trace: {name: tiny, ...}`` or ``trace: tiny``."""
    return section.get("name") if isinstance(section, dict) else section


def _fmt_value(v) -> str:
    return "null" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def engine_label(config: dict) -> str:
    """Every key of config.yaml's engine section but its name, e.g. 'device=cpu, dtype=float32'."""
    section = config.get("engine")
    flat = _flatten(section) if isinstance(section, dict) else {}
    return ", ".join(f"{k}={_fmt_value(v)}" for k, v in sorted(flat.items())
                     if k and k != "name") or "unrecorded"


def hardware_label(summary: dict) -> str:
    """The machine of summary.json's hardware (``HARDWARE_KEYS``); 'unknown' where not recorded."""
    hw = summary.get("hardware") or {}
    parts = [f"{k}={_fmt_value(hw[k])}" for k in HARDWARE_KEYS if hw.get(k) is not None]
    return ", ".join(parts) or "unknown"


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Run folders at or under each path (a run folder holds steps.parquet/ or summary.json)."""
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise RunFolderError(f"{path} does not exist; pass a run folder or a folder of runs")
        before = len(found)
        for dirpath, dirnames, filenames in os.walk(path):
            if STEPS_DIR in dirnames or "summary.json" in filenames:
                found.append(Path(dirpath))
                dirnames.clear()
            else:
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if len(found) == before:
            raise RunFolderError(
                f"no run folders under {path}: a run folder holds config.yaml, summary.json, "
                f"rollouts.parquet/ and steps.parquet/. Pass a run folder or a folder of runs.")
    return sorted(dict.fromkeys(p.resolve() for p in found))


def load_runs(paths: Iterable[str | Path], progress: bool = True):
    """(runs, rollouts, steps, configs) of every run found; run ids made unique across folders."""
    dirs = find_run_dirs(paths)
    runs, rollouts, steps, configs = [], [], [], {}
    for run_dir in tqdm(dirs, desc="loading runs", disable=not progress or len(dirs) < 2):
        config, summary, r, s = load_run(run_dir)
        run_id = str(summary.get("run_id") or run_dir.name)
        if run_id in configs:  # the same id from another machine or copy
            run_id = f"{run_id}@{run_dir.parent.name}/{run_dir.name}"
        configs[run_id] = config
        info = {"run_id": run_id, "run_dir": str(run_dir), "status": summary.get("status"),
                "start_time": summary.get("start_time"), "sampling": sampling_label(config),
                "trace": _named(config.get("trace")) or summary.get("trace"),
                "engine": summary.get("engine") or _named(config.get("engine")),
                "engine_config": engine_label(config), "hardware": hardware_label(summary)}
        runs.append(info)
        for frame in (r, s):
            frame["run_id"] = run_id
            for k in ("sampling", "engine_config", "hardware"):
                frame[k] = info[k]
            for k in ("trace", "engine"):
                frame[k] = frame[k].fillna(info[k]) if k in frame else info[k]
        rollouts.append(r)
        steps.append(s)
    return (pd.DataFrame(runs), pd.concat(rollouts, ignore_index=True),
            pd.concat(steps, ignore_index=True), configs)


def _method_section(config: dict, method: str) -> dict:
    """A method's knobs in a run config: ``method: {name: {...}}`` (one or many methods per run)."""
    section = config.get("method") or {}
    if isinstance(section, dict) and isinstance(section.get(method), dict):
        return section[method]
    return section if isinstance(section, dict) else {}


def _select(runs, steps, configs, baseline: str) -> tuple[dict[tuple[str, str], str], list[str]]:
    """{(run_id, method): label} of the rows to use, and notes on variants and duplicates."""
    notes, chosen = [], {}
    info = runs.set_index("run_id")
    counts = steps.groupby(["run_id", *GROUP, "method"], dropna=False).size().reset_index(name="n")
    for key, grp in counts.groupby([*GROUP, "method"], dropna=False, sort=True):
        method, where = key[-1], "/".join(map(str, key[:-1]))
        # knob sweeps (config.yaml ``method:`` differs) are variants; the baseline has no knobs
        knobs = {rid: {} if method == baseline else
                 {k: v for k, v in _flatten(_method_section(configs[rid], method)).items() if k}
                 for rid in grp["run_id"]}
        varying = sorted(k for k in set().union(*knobs.values())
                         if len({repr(v.get(k)) for v in knobs.values()}) > 1)
        labels = {rid: method + (" [" + ", ".join(f"{k}={knobs[rid].get(k)}" for k in varying) + "]"
                                 if varying else "") for rid in grp["run_id"]}
        for label in dict.fromkeys(labels.values()):
            cand = grp[grp["run_id"].map(labels) == label].assign(
                complete=lambda d: d["run_id"].map(info["status"]).eq("complete"),
                start=lambda d: d["run_id"].map(info["start_time"]).fillna(""))
            best = cand.sort_values(["complete", "n", "start"]).iloc[-1]
            chosen[(best["run_id"], method)] = label
            if len(cand) > 1:
                others = ", ".join(r for r in cand["run_id"] if r != best["run_id"])
                notes.append(f"{where}/{label} appears in {len(cand)} runs; using {best['run_id']} "
                             f"({info.at[best['run_id'], 'status']}, {best['n']} steps), "
                             f"not {others}")
    return chosen, notes


def _where(key: tuple) -> str:
    """A GROUP key as words: 'trace tiny, engine torch_ref (settings ...), hardware ..., sampling ...'."""
    trace, engine, settings, hardware, sampling = key
    return f"trace {trace}, engine {engine} ({settings}), hardware {hardware}, {sampling}"


def _pair(runs: pd.DataFrame, steps: pd.DataFrame, chosen: dict, baseline: str,
          notes: list[str]) -> dict[str, str | None]:
    """{run_id: the run whose baseline it is compared with, or None} for every run in use: its own
    run where that has the baseline, else the one baseline run of the same setup (GROUP)."""
    info = runs.set_index("run_id")
    key = lambda rid: tuple(info.at[rid, k] for k in GROUP)
    with_base = sorted(set(steps.loc[steps["method"] == baseline, "run_id"]))
    by_key: dict[tuple, list[str]] = {}
    for rid in with_base:
        by_key.setdefault(key(rid), []).append(rid)
    pairs: dict[str, str | None] = {}
    missing: dict[tuple, list[str]] = {}
    for rid in sorted({r for r, _ in chosen}):
        if rid in with_base:
            pairs[rid] = rid
            continue
        cands = by_key.get(key(rid), [])
        pairs[rid] = cands[0] if len(cands) == 1 else None
        if len(cands) > 1:
            notes.append(f"run {rid}: {len(cands)} '{baseline}' runs have its setup "
                         f"({_where(key(rid))}): {', '.join(cands)}; speedup, reward "
                         f"delta and identity are NaN for it rather than a pick among them. Collect "
                         f"only one of them, or run the baseline in the same run as the method.")
        elif not cands:
            missing.setdefault(key(rid), []).append(rid)
    for k, rids in missing.items():
        near = [b for b in with_base
                if key(b)[:2] == k[:2] and key(b)[-1] == k[-1]]  # same trace, engine, sampling
        why = (f" (baseline run(s) {', '.join(near)} ran with other engine settings or hardware, so "
               f"they are not used)" if near else "")
        notes.append(f"no '{baseline}' run with the same setup ({_where(k)}): speedup and reward "
                     f"delta are NaN for run(s) {', '.join(rids)}{why}")
    return pairs


def _vs_baseline(per_step: pd.DataFrame, base_rollouts: pd.DataFrame, base_steps: pd.DataFrame,
                 pairs: dict[str, str | None]) -> pd.DataFrame:
    """Per-step rows with the paired baseline's wall time and reward: speedup, reward delta."""
    base = summarize(base_rollouts, base_steps, ["run_id"], per_step=True)
    base = base[["run_id", "step", "rollout_wall_s", "reward_mean"]].rename(
        columns={"run_id": "baseline_run"})
    per_step = per_step.assign(baseline_run=per_step["run_id"].map(pairs))
    out = per_step.merge(base, on=["baseline_run", "step"], how="left", suffixes=("", "_baseline"))
    out["speedup"] = out["rollout_wall_s_baseline"] / out["rollout_wall_s"].where(out["rollout_wall_s"] > 0)
    # rounded: two groupings of the same rewards can sum in another order (a 1e-17 "delta" between
    # token-identical runs reads like a change; real reward differences are >= 1 / rollouts)
    out["reward_delta"] = (out["reward_mean"] - out["reward_mean_baseline"]).round(12) + 0.0  # no "-0"
    return out


def _verify_rule(config: dict, method: str) -> str | None:
    verify = _method_section(config, method).get("verify")
    return verify.get("rule") if isinstance(verify, dict) else None


def _identity(table: pd.DataFrame, chosen: dict, pairs: dict, configs: dict, rollouts: pd.DataFrame,
              baseline: str) -> pd.DataFrame:
    """identity_rate and rule_divergences of every exact method on a coupled engine (else NaN)."""
    from bench.core.precision import divergence_summary, near_tie_threshold
    method_of = {(rid, label): m for (rid, m), label in chosen.items()}
    rows = lambda rid, m: rollouts[(rollouts["run_id"] == rid) & (rollouts["method"] == m)]
    rates, divergences = [], []
    for rid, label, engine in zip(table["run_id"], table["method"], table["engine"]):
        m, base_run = method_of.get((rid, label)), pairs.get(rid)
        rule = _verify_rule(configs[rid], m) if m else None
        result = {}
        if (m != baseline and base_run is not None and engine in COUPLED_ENGINES
                and rule is not None and rule != "ratio"):
            section = configs[rid].get("engine")
            dtype = (section.get("dtype") if isinstance(section, dict) else None) or "float32"
            result = divergence_summary(rows(rid, m), rows(base_run, baseline), near_tie_threshold(dtype))
        rates.append(result.get("identity_rate", np.nan))
        div = result.get("rule_divergences")
        divergences.append(np.nan if div is None else div)
    return table.assign(identity_rate=np.array(rates, dtype=float),
                        rule_divergences=np.array(divergences, dtype=float))


def collect(paths: Iterable[str | Path], baseline: str = "baseline", progress: bool = True) -> Collection:
    """Load, deduplicate, and compare every run under ``paths`` (see the module docstring)."""
    paths = list(paths)
    runs, rollouts, steps, configs = load_runs(paths, progress)
    chosen, notes = _select(runs, steps, configs, baseline)
    if steps.empty:
        raise RunFolderError(f"the runs under {', '.join(map(str, paths))} have no finished "
                             f"(step, method) unit yet; collect again when one has finished")
    pairs = _pair(runs, steps, chosen, baseline, notes)
    is_base = lambda d: (d["method"] == baseline) & d["run_id"].isin({b for b in pairs.values() if b})
    base_rollouts, base_steps = rollouts[is_base(rollouts)], steps[is_base(steps)]
    all_rollouts = rollouts
    keep = lambda d: d.loc[np.array([(r, m) in chosen for r, m in zip(d["run_id"], d["method"])],
                                    dtype=bool)].assign(
        method=lambda x: [chosen[(r, m)] for r, m in zip(x["run_id"], x["method"])])
    rollouts, steps = keep(rollouts), keep(steps)
    by = [*GROUP, "method"]
    per_step = _vs_baseline(summarize(rollouts, steps, [*by, "run_id"], per_step=True),
                            base_rollouts, base_steps, pairs)
    table = summarize(rollouts, steps, by)
    common = per_step.dropna(subset=["rollout_wall_s_baseline", "rollout_wall_s"])
    agg = common.groupby(by, dropna=False).agg(
        base_wall=("rollout_wall_s_baseline", "mean"), wall=("rollout_wall_s", "mean"),
        speedup_std=("speedup", lambda s: s.std(ddof=0)),
        reward_delta=("reward_delta", "mean")).reset_index()
    agg["speedup"] = agg["base_wall"] / agg["wall"].where(agg["wall"] > 0)
    table = table.merge(agg[by + ["speedup", "speedup_std", "reward_delta"]], on=by, how="left")
    used = steps.groupby(by, dropna=False)["run_id"].first().rename("run_id").reset_index()
    table = table.merge(used, on=by, how="left")
    table["baseline_run"] = table["run_id"].map(pairs)
    table = _identity(table, chosen, pairs, configs, all_rollouts, baseline)
    per_step, table = _with_tail_share(runs, per_step, table, keep, by)
    notes += stale_drafter_notes(steps)
    return Collection(runs, rollouts, steps, table, per_step, notes)


def stale_drafter_notes(steps: pd.DataFrame) -> list[str]:
    """One note per method whose learned drafter's acceptance collapsed against its own recent steps
    (``drafter_stale``, bench/drafters/learned.py): a weight sync that did not reach the drafter,
    or broke it, looks exactly like this while every token stays exact."""
    if "drafter_stale" not in steps:
        return []
    flagged = steps[steps["drafter_stale"].fillna(0) > 0]
    return [f"STALE DRAFTER: {method}'s acceptance collapsed at step(s) {sorted(set(map(int, grp['step'])))} "
            f"against its own recent steps: check that its weights were updated and loaded"
            for method, grp in flagged.groupby("method", sort=True)]


def _with_tail_share(runs, per_step, table, keep, by):
    """``tail_share`` (bench.report.stats) per step from each run's iterations.parquet, and its mean per method."""
    from bench.report.results import load_iterations
    parts = [load_iterations(d).assign(run_id=r) for r, d in zip(runs["run_id"], runs["run_dir"])]
    parts = [keep(p) for p in parts if not p.empty]
    if not parts:
        return per_step.assign(tail_share=np.nan), table.assign(tail_share=np.nan)
    shares = tail_share(pd.concat(parts, ignore_index=True))
    per_step = per_step.merge(shares, on=["run_id", "method", "step"], how="left")
    mean = per_step.groupby(by, dropna=False)["tail_share"].mean().rename("tail_share").reset_index()
    return per_step, table.merge(mean, on=by, how="left")


def _fmt(v) -> str:
    if isinstance(v, (float, np.floating)):
        return "" if pd.isna(v) else f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def to_markdown(df: pd.DataFrame) -> str:
    fmt = _fmt
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def report(col: Collection) -> str:
    """The results table as Markdown, one section per engine (then trace and sampling)."""
    parts = []
    keys = ["engine", "trace", "sampling", "engine_config", "hardware"]
    for (engine, trace, sampling, settings, hardware), grp in col.table.groupby(keys, sort=True):
        setup = f"engine settings: {settings} · hardware: {hardware}"
        parts.append(f"## engine {engine} · trace {trace} · {sampling}\n\n{setup}\n\n"
                     + to_markdown(grp[list(DISPLAY)]))
    if col.notes:
        parts.append("Notes:\n\n" + "".join(f"- {n}\n" for n in col.notes))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> Collection:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="run folders or folders containing runs")
    ap.add_argument("--out", type=Path, help="write results.csv and results.md here")
    ap.add_argument("--baseline", default="baseline", help="method every speedup is relative to")
    args = ap.parse_args(argv)
    col = collect(args.paths, args.baseline)
    text = report(col)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        col.table.to_csv(args.out / "results.csv", index=False)
        col.per_step.to_csv(args.out / "results_per_step.csv", index=False)
        (args.out / "results.md").write_text("# Results\n\n" + text)
        print(f"wrote {args.out / 'results.csv'} and {args.out / 'results.md'}")
    return col


if __name__ == "__main__":
    from bench.core.errors import run_main
    run_main(main)
