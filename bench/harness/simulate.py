"""Offline replay of recorded rollouts through drafters, no model: acceptance numbers for traces and run logs.

    python -m bench.harness.simulate TRACE_OR_LOG_DIR --method tree_cache --method history_spec [--out FILE]
    python -m bench.harness.simulate TRACE_DIR --method tree_cache --method tree_cache:match=best   # a knob variant

A recorded token is a sample of the target policy, so the draft tokens that match a rollout's
recorded continuation are exactly what exact verification would accept. Each step's rollouts form
one batch, driven by the engine's own scheduler (``bench.spec.scheduler``) over the recorded-tokens
backend (``bench.spec.recorded``): the same calls in the same order, the same caps and forward
passes, the same counters and iteration log as a torch_ref replay of the same steps
(``tests/test_simulate.py`` checks the equality), so ``bench.report.stats`` applies as is.

Two oracles, not to be confused:

- ``future_oracle`` (a method, ``--method future_oracle``) knows the future: every iteration it
  drafts the rollout's whole remaining recorded continuation, so each rollout takes one forward
  pass. It bounds what any drafter could gain on that rollout, whatever its cache.
- ``cache_oracle_tokens_per_step`` (a column beside every method) is the best any copying drafter
  could do with the same cache contents as that method, under that method's draft budget: a bound
  for that method (``tests/test_simulate.py`` asserts it, per rollout). At each iteration a row's
  accepted length is the longest prefix of its remaining recorded tokens, capped by the budget,
  that occurs as a contiguous run anywhere in the cache texts at that moment; the row advances by
  that plus the bonus token (its own iteration, so the oracle's siblings advance at the oracle's
  pace: they are never behind the method's, so its cache holds at least the method's). The
  ``cache_oracle`` column names the cache and the budget (``cache_bound``): ``prompt`` caches hold
  the same prompt's recorded rollouts finished before that iteration (all earlier steps, and
  siblings of this step that already finished, as a finish-time history cache holds them), plus,
  ``in flight``, the tokens emitted so far this step by the prompt's running rollouts (its own
  included); ``all prompts`` (suffix_global, and any drafter the table does not know) holds every
  rollout's prompt and response, in flight. The budget is the method's ``max_spec_tokens`` (each
  draft also fits the engine's ``max_new_tokens - len(output) - 1``). The texts live in a suffix
  automaton (``methods.oracle.SuffixAutomaton``), linear in the tokens whatever the budget.

Methods with the lenient ``ratio`` rule are refused (they need both policies' probabilities:
``python -m bench.benchmarks.bias`` measures them); run-ahead needs the engine.

Inputs: a trace directory (its recorded rollouts and prompts), or a folder of run logs alone:
one jsonl or parquet file per step named ``step_<N>`` (``step_00003.parquet``, ``step_3.jsonl``)
with prompt_id, sample_idx, token_ids and optionally prompt_token_ids, logprobs, reward.
"""
from __future__ import annotations

import argparse
import re
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import pandas as pd

from methods.base import NullDrafter, Rollout, RolloutKey
from methods.baseline import Baseline
from methods.history_spec import HistorySpecDrafter
from methods.hybrid import HybridDrafter
from methods.oracle import OracleDrafter, SuffixAutomaton
from methods.prefix_reuse import PrefixReuseDrafter
from methods.suffix_global import SuffixGlobalDrafter
from methods.tree_cache import TreeCacheDrafter

from bench.core.engine_protocol import Request
from bench.core.paths import METHOD_CONF_DIR
from bench.core.errors import UserError
from bench.core.sampling import SamplingConfig
from bench.spec.recorded import Recorded, RecordedBackend, feed_finished, recorded_rows
from bench.spec.scheduler import Scheduler
from bench.spec.policy import SpecPolicy
from bench.report.stats import rollout_metrics, safe_div
from bench.traces.format import iter_jsonl
from bench.core.verify import VerifyConfig

METHOD_DIR = METHOD_CONF_DIR
LOG_RE = re.compile(r"^step_?(\d+)\.(jsonl|parquet)$")
LOG_COLUMNS = ("prompt_id", "sample_idx", "token_ids")
LOG_LAYOUT = ("a trace directory (trace.yaml with recorded rollouts/step_XXXXX.parquet), or a folder "
              "of run logs: one file per step named step_<N>.jsonl or step_<N>.parquet "
              "(e.g. step_00003.parquet, step_3.jsonl) with prompt_id, sample_idx, token_ids and "
              "optional prompt_token_ids, logprobs, reward")
ROW_COLUMNS = ("method", "step", "prompt_id", "sample_idx", "output_len", "num_drafts", "num_draft_tokens",
               "num_accepted_tokens", "num_accepted_tokens_per_pos", "num_forward_passes",
               "cache_oracle_num_forward_passes", "cache_oracle", "finish_reason", "reward")
FUTURE_ORACLE = "future_oracle"


class SimulationError(UserError, ValueError):
    """Input or method that cannot be simulated; the message names the file or method and the fix."""


class RecordedOracle(NullDrafter):
    """The future oracle over the recorded rollouts: each step's futures are that step's tokens.

    Selected with ``--method future_oracle``: every iteration drafts the whole remaining recorded
    continuation, so each rollout takes one forward pass (the upper bound of any drafter).
    """

    name = FUTURE_ORACLE

    def __init__(self, max_spec_tokens: int | None = None):
        self.max_spec_tokens = max_spec_tokens
        self._inner = OracleDrafter({}, max_spec_tokens)

    def set_futures(self, futures: Mapping[RolloutKey, list[int]]) -> None:
        self._inner = OracleDrafter(futures, self.max_spec_tokens)

    def start(self, key, prompt):
        self._inner.start(key, prompt)

    def propose(self, key, output, budget):
        return self._inner.propose(key, output, budget)

    def observe(self, key, new_tokens):
        self._inner.observe(key, new_tokens)

    def stats(self) -> dict:
        return {}


# ---------------------------------------------------------------- methods

def method_config(name: str):
    """The method's config (``conf/method/<name>.yaml``); ``future_oracle`` is the built-in recorded oracle.

    ``NAME:knob=value,knob=value`` is that config with drafter knobs overridden (values read as
    YAML), e.g. ``tree_cache:match=best`` or ``seer:max_batch_draft_tokens=null``.
    """
    from omegaconf import OmegaConf
    if ":" in name:
        import yaml
        base, _, sets = name.partition(":")
        cfg = method_config(base)
        for item in filter(None, sets.split(",")):
            knob, eq, value = item.partition("=")
            if not eq or knob.strip() not in cfg.drafter:
                raise SimulationError(f"method {name!r}: {item!r} is not knob=value for a knob of "
                                      f"{base!r}; its knobs: {sorted(k for k in cfg.drafter if k != '_target_')}")
            cfg.drafter[knob.strip()] = yaml.safe_load(value)
        cfg.name = name
        return cfg
    if name == FUTURE_ORACLE:
        return OmegaConf.create({"name": FUTURE_ORACLE, "drafter": {"_target_": "bench.harness.simulate.RecordedOracle"},
                                 "verify": {"rule": "exact"}, "run_ahead": False})
    path = METHOD_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in METHOD_DIR.glob("*.yaml")) + [FUTURE_ORACLE]
        raise SimulationError(f"unknown method {name!r}: {path} does not exist; known methods: {known}")
    return OmegaConf.load(path)


def simulable_methods() -> list[str]:
    """Every configured method simulation can run (exact rules, no run-ahead), plus the future oracle."""
    out = []
    for p in sorted(METHOD_DIR.glob("*.yaml")):
        try:
            check_simulable(p.stem, method_config(p.stem))
        except SimulationError:
            continue
        out.append(p.stem)
    return out + [FUTURE_ORACLE]


def check_simulable(name: str, cfg) -> None:
    verify = cfg.get("verify") or {}
    rule = verify.get("rule", "exact")
    if rule == "ratio":
        raise SimulationError(
            f"method {name!r} uses verify.rule=ratio (SPEC-RL's lenient test), which accepts by the "
            f"ratio of the new and old policies' probabilities: recorded tokens cannot tell what it "
            f"would accept, simulation needs exact verification. Simulate prefix_reuse_exact (the same "
            f"cache, exact rule), or measure the ratio rule's bias with `python -m bench.benchmarks.bias TRACE_DIR`")
    if cfg.get("run_ahead"):
        raise SimulationError(f"method {name!r} has run_ahead: true; run-ahead rollouts are generated by "
                              f"the engine and are not in the recorded rollouts, so simulation cannot "
                              f"replay them: simulate the method without run-ahead (e.g. tree_cache)")


def build_drafter(name: str, cfg):
    """A drafter from a method config (mapping with ``drafter``/``verify``) or a drafter instance."""
    if hasattr(cfg, "propose"):
        return cfg
    check_simulable(name, cfg)
    from hydra.utils import instantiate
    return instantiate(cfg["drafter"])


def uses_in_flight(drafter) -> bool:
    """Whether the drafter reads tokens of rollouts still running (decides the oracle's cache)."""
    if isinstance(drafter, RecordedOracle):
        return False
    inner = getattr(drafter, "tree_cache", None)  # hybrid
    return bool(getattr(inner if inner is not None else drafter, "in_flight", False))


class CacheBound(NamedTuple):
    """What the cache oracle beside a method may copy from: ``scope`` ``none`` (drafts nothing),
    ``prompt`` (the prompt's own rollouts) or ``all`` (every rollout's prompt and response); with
    ``in_flight`` the running rollouts' tokens too; ``budget`` draft tokens per iteration (None:
    only the engine's ``max_new_tokens - len(output) - 1``)."""

    scope: str
    in_flight: bool
    budget: int | None

    def label(self) -> str:
        if self.scope == "none":
            return "no cache (budget 0)"
        where = "prompt" if self.scope == "prompt" else "all prompts"
        return (f"{where}, {'in flight' if self.in_flight else 'finished'}, "
                f"budget {'engine' if self.budget is None else self.budget}")


def cache_bound(drafter) -> CacheBound | None:
    """The cache and budget that bound a drafter's accepted tokens; None for the future oracle.

    | drafter | its cache | bound |
    | --- | --- | --- |
    | baseline | none | budget 0 |
    | prefix_reuse(_exact), history_spec | the prompt's earlier rollouts | prompt, finished |
    | tree_cache (and das, seer) | the prompt's rollouts, running ones with ``in_flight`` | prompt |
    | hybrid | prefix reuse + tree cache | prompt, the tree's in_flight, budget max of both parts |
    | suffix_global | every response, and the request's prompt + output | all prompts, in flight |
    | any other | unknown | all prompts, in flight, the engine budget |

    Every draft token of these drafters is copied from a contiguous run of their cache texts (a
    trie path is a substring of one inserted sequence), so the accepted tokens of one iteration
    are a run of those texts that continues the rollout: at most the oracle's. A drafter that
    generates tokens from elsewhere (a model) is not bounded by it. The ``all`` scope for
    suffix_global with ``in_flight=False`` is wider than its cache, still a bound.
    """
    if isinstance(drafter, RecordedOracle):
        return None
    if isinstance(drafter, Baseline):
        return CacheBound("none", False, 0)
    if isinstance(drafter, HybridDrafter):
        parts = (drafter.prefix.max_spec_tokens, drafter.tree_cache.max_spec_tokens)
        return CacheBound("prompt", uses_in_flight(drafter), None if None in parts else max(parts))
    if isinstance(drafter, SuffixGlobalDrafter):
        return CacheBound("all", True, drafter.max_spec_tokens)
    if isinstance(drafter, (TreeCacheDrafter, HistorySpecDrafter, PrefixReuseDrafter)):
        return CacheBound("prompt", uses_in_flight(drafter), drafter.max_spec_tokens)
    return CacheBound("all", True, None)


# ---------------------------------------------------------------- the replay loop

def run_step(drafter, step: int, rows: list[Recorded], prompts: Mapping[str, list[int]], max_new_tokens: int,
             policy: SpecPolicy | None = None, prices=None, iteration_log: list | None = None) -> list[Rollout]:
    """One step's recorded rollouts through the drafter by the engine's scheduler
    (``bench.spec.scheduler``) over the recorded-tokens backend; the rollouts in row order.
    ``iteration_log``, if given, gets the scheduler's one dict per pass; ``prices``
    (``bench.spec.prices.TablePrices``) prices every pass on a virtual clock."""
    if isinstance(drafter, RecordedOracle):
        drafter.set_futures({r.key: r.tokens for r in rows})
    drafter.begin_step(step)
    scheduler = Scheduler(RecordedBackend({r.key: r for r in rows}), policy or SpecPolicy("fixed"), prices=prices)
    if iteration_log is not None:
        scheduler.iteration_log = iteration_log
    requests = [Request(r.key, list(prompts.get(r.key.prompt_id, ())), step) for r in rows]
    calls = scheduler.run(requests, SamplingConfig(max_new_tokens=max_new_tokens), drafter, VerifyConfig())
    while True:
        try:
            next(calls)
        except StopIteration as done:
            return done.value


# ---------------------------------------------------------------- the cache oracle

def oracle_passes(rollouts_by_step: Mapping[int, pd.DataFrame], max_new_tokens: int, in_flight: bool,
                  budget: int | None = None, scope: str = "prompt",
                  prompts: Mapping[str, list[int]] | None = None) -> dict[tuple[int, str, int], int]:
    """Forward passes per (step, prompt_id, sample_idx) of the cache oracle (module docstring).

    ``scope``: ``prompt`` (one automaton per prompt: its responses), ``all`` (one automaton:
    every rollout's prompt, then its response; always in flight) or ``none`` (budget 0: one
    token per pass). ``budget``: draft tokens per iteration (None: the engine's only).
    Memory and time are linear in the tokens (``SuffixAutomaton``), whatever the budget.
    """
    if scope == "none" or budget == 0:
        return {(step, str(p), int(i)): max(1, min(len(t), max_new_tokens))
                for step, df in rollouts_by_step.items()
                for p, i, t in zip(df["prompt_id"], df["sample_idx"], df["token_ids"])}
    if scope not in ("prompt", "all"):
        raise ValueError(f"scope must be none, prompt or all, got {scope!r}")
    in_flight = in_flight or scope == "all"
    prompts = prompts or {}
    caches: dict[str, SuffixAutomaton] = {}
    passes: dict[tuple[int, str, int], int] = {}
    seq = 0
    for step in sorted(rollouts_by_step):
        rows = [_OracleRow(r.key, r.tokens) for r in recorded_rows(rollouts_by_step[step], max_new_tokens)]
        ids, cache = {}, {}
        for r in rows:
            pid = r.key.prompt_id
            cache[r.key] = caches.setdefault(pid if scope == "prompt" else "", SuffixAutomaton())
            ids[r.key], seq = seq, seq + 1
            if scope == "all":
                cache[r.key].extend(ids[r.key], prompts.get(pid, ()))
        live = rows
        while live:
            lengths = []
            for r in live:  # every row sees the cache as it was when the iteration began
                limit = max_new_tokens - r.pos - 1
                if budget is not None:
                    limit = min(limit, budget)
                m = cache[r.key].longest_prefix(r.rec, r.pos, limit) if limit > 0 else 0
                lengths.append(min(m + 1, len(r.rec) - r.pos))
            for r, n in zip(live, lengths):
                if in_flight and n > 0:
                    cache[r.key].extend(ids[r.key], r.rec[r.pos:r.pos + n])
                r.pos += n
                r.passes += 1
            for r in live:
                if r.pos >= len(r.rec):
                    passes[(step, r.key.prompt_id, r.key.sample_idx)] = r.passes
                    if not in_flight and r.rec:
                        cache[r.key].extend(ids[r.key], r.rec)
            live = [r for r in live if r.pos < len(r.rec)]
    return passes


class _OracleRow:
    __slots__ = ("key", "rec", "pos", "passes")

    def __init__(self, key: RolloutKey, rec: list[int]):
        self.key, self.rec, self.pos, self.passes = key, rec, 0, 0


# ---------------------------------------------------------------- API

SIM_POLICIES = ("fixed", "batch_threshold", "throughput_optimal")


def simulate(rollouts_by_step: Mapping[int, pd.DataFrame], prompts: Mapping[str, list[int]],
             method_cfgs: Mapping[str, Any], max_new_tokens: int, progress: bool = False,
             policy: str = "fixed", spec_max_rows: int = 32, run_steps: Sequence[int] | None = None,
             prices=None, jobs: int = 1) -> pd.DataFrame:
    """Per-rollout rows (``ROW_COLUMNS``) of every method over the steps in increasing order.

    ``policy`` / ``spec_max_rows``: the engine's speculation policy (``engine.spec_policy``,
    ``engine.spec_max_rows``); ``throughput_optimal`` needs ``prices`` (``bench.spec.prices.TablePrices``
    of a latency table or a ``RooflineTable``), which then price every pass and time nothing else, as
    torch_ref's ``engine.seconds=table`` does. ``run_steps``: the steps simulated (default: every step); the other
    recorded steps before the last of them are fed to the drafters as finished rollouts, as a
    sparse replay feeds its rollouts-only steps. ``rows.attrs["iterations"]``: the scheduler's
    iteration log (one row per pass, with method and step), the engine's ``iterations.parquet``.

    method_cfgs: name -> method config (a mapping with ``drafter`` and ``verify``, as in
    ``conf/method/<name>.yaml``) or a drafter instance (taken to be verified exactly). Each
    method gets a fresh drafter that lives across all steps. Beside each method's counters, the
    cache oracle's forward passes under ``cache_bound(drafter)`` (one oracle run per distinct
    bound). ``rows.attrs["timings"]``: seconds per method and per cache oracle. ``jobs``: methods
    simulated in that many processes at once (each method alone in its process, the results put
    together in the order of ``method_cfgs``: the same frame as a serial run's).
    """
    if max_new_tokens < 1:
        raise SimulationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if policy not in SIM_POLICIES:
        raise SimulationError(f"policy {policy!r} is not a speculation policy: use one of {SIM_POLICIES}")
    if policy == "throughput_optimal" and prices is None:
        raise SimulationError("policy throughput_optimal decides from seconds: give one price target (--table CSV "
                              "or --predict HARDWARE:MODEL)")
    run = sorted(rollouts_by_step) if run_steps is None else sorted(run_steps)
    missing = [s for s in run if s not in rollouts_by_step]
    if missing:
        raise SimulationError(f"steps {missing} have no recorded rollouts; recorded steps: {sorted(rollouts_by_step)}")
    fed = {s: [f for f in sorted(rollouts_by_step) if f not in run and f < s and (i == 0 or f > run[i - 1])]
           for i, s in enumerate(run)}
    iterations: list[dict] = []
    for name, cfg in method_cfgs.items():  # refuse before anything runs
        if not hasattr(cfg, "propose"):
            check_simulable(name, cfg)
    if jobs < 1:
        raise SimulationError(f"jobs must be >= 1, got {jobs}")
    if jobs > 1 and len(method_cfgs) > 1:
        return _in_processes(rollouts_by_step, prompts, method_cfgs, max_new_tokens, progress, jobs,
                             dict(policy=policy, spec_max_rows=spec_max_rows, run_steps=run_steps, prices=prices))
    from tqdm.auto import tqdm
    oracles: dict[CacheBound, dict] = {}
    timings: dict[str, float] = {}
    frames = []
    for name, cfg in method_cfgs.items():
        drafter = build_drafter(name, cfg)  # one at a time: a drafter's caches go when it is done
        bound = cache_bound(drafter)
        if bound is not None and bound.budget is not None and bound.budget >= max_new_tokens - 1:
            bound = bound._replace(budget=None)  # the engine's budget is the tighter one everywhere
        if bound is not None and bound not in oracles:
            t0 = time.perf_counter()
            oracles[bound] = oracle_passes(rollouts_by_step, max_new_tokens, bound.in_flight, bound.budget,
                                           bound.scope, prompts)
            timings[f"cache oracle [{bound.label()}]"] = time.perf_counter() - t0
        passes = oracles.get(bound, {})
        label = "" if bound is None else bound.label()
        out = []
        t0 = time.perf_counter()
        spec = SpecPolicy(policy, spec_max_rows, None if prices is None else prices.table)
        for step in tqdm(run, desc=f"simulate {name}", disable=not progress):
            for f in fed[step]:
                feed_finished(drafter, f, recorded_rows(rollouts_by_step[f], max_new_tokens, cut=False), prompts)
            rows = recorded_rows(rollouts_by_step[step], max_new_tokens)
            log: list[dict] = []
            done = run_step(drafter, step, rows, prompts, max_new_tokens, policy=spec, prices=prices,
                            iteration_log=log)
            iterations += [{"method": name, "step": step, **c} for c in log]
            out += [(name, step, r.key.prompt_id, r.key.sample_idx, len(r.tokens), o.num_drafts,
                     o.num_draft_tokens, o.num_accepted_tokens, o.num_accepted_tokens_per_pos,
                     o.num_forward_passes, passes.get((step, r.key.prompt_id, r.key.sample_idx), 0), label,
                     r.finish_reason, r.reward)
                    for r, o in zip(rows, done)]
        timings[name] = time.perf_counter() - t0
        del drafter
        frames.append(pd.DataFrame(out, columns=list(ROW_COLUMNS)))
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(ROW_COLUMNS))
    rows.attrs["timings"] = timings
    rows.attrs["iterations"] = pd.DataFrame(iterations)
    return rows


_SHARED: tuple = ()  # (rollouts_by_step, prompts) for forked workers: inherited, never pickled per task


def _one_method(name, cfg, max_new_tokens, options) -> pd.DataFrame:
    rollouts_by_step, prompts = _SHARED
    return simulate(rollouts_by_step, prompts, {name: cfg}, max_new_tokens, False, **options)


def _in_processes(rollouts_by_step, prompts, method_cfgs, max_new_tokens, progress, jobs, options) -> pd.DataFrame:
    """``simulate`` with one method per worker process, ``jobs`` at a time, put back in method order.
    Workers are forked where the platform allows, so the recorded rollouts are shared, not copied per
    task; a method's drafter seconds are measured under the others' load."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm.auto import tqdm
    global _SHARED
    methods = list(method_cfgs)
    fork = "fork" in multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if fork else "spawn")
    parts: dict[str, pd.DataFrame] = {}
    _SHARED = (rollouts_by_step, prompts)
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(methods)), mp_context=context,
                                 initializer=None if fork else _share, initargs=() if fork else _SHARED) as pool:
            futures = {pool.submit(_one_method, name, method_cfgs[name], max_new_tokens, options): name
                       for name in methods}
            for future in tqdm(as_completed(futures), total=len(futures), desc=f"simulate ({jobs} jobs)",
                               disable=not progress):
                parts[futures[future]] = future.result()
    finally:
        _SHARED = ()
    frames = [parts[name] for name in methods]
    rows = pd.concat(frames, ignore_index=True)
    timings: dict[str, float] = {}
    for frame in frames:
        timings.update(frame.attrs["timings"])
    rows.attrs["timings"] = timings
    rows.attrs["iterations"] = pd.concat([f.attrs["iterations"] for f in frames], ignore_index=True)
    return rows


def _share(rollouts_by_step, prompts) -> None:
    """A spawned worker's copy of the data (where fork is not available)."""
    global _SHARED
    _SHARED = (rollouts_by_step, prompts)


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


# ---------------------------------------------------------------- inputs

def load_input(path: str | Path) -> tuple[dict[int, pd.DataFrame], dict[str, list[int]], int | None]:
    """(rollouts by step, prompts, max_new_tokens or None) from a trace dir or a log folder."""
    root = Path(path)
    if not root.is_dir():
        raise SimulationError(f"{root} is not a directory; expected {LOG_LAYOUT}")
    from bench.traces.format import MANIFEST, Trace, TraceError
    if (root / MANIFEST).exists():
        try:
            trace = Trace.load(root, validate=False)  # checkpoints are not needed: no model here
        except TraceError as exc:
            raise SimulationError(str(exc)) from exc
        steps = {}
        for s in trace.steps:
            if s.rollouts is not None:  # in the replay's row order: the step's prompts, then samples
                df = trace.rollouts(s.step)
                order = {p: i for i, p in enumerate(s.prompt_ids)}
                steps[s.step] = (df.assign(_order=df["prompt_id"].astype(str).map(order))
                                 .sort_values(["_order", "sample_idx"], kind="stable")
                                 .drop(columns="_order").reset_index(drop=True))
        if not steps:
            raise SimulationError(f"trace {root} records no rollouts (no step has a `rollouts` file in "
                                  f"{root / MANIFEST}); simulation replays recorded rollouts: re-record "
                                  f"the trace with rollouts or pass a folder of run logs")
        return steps, dict(trace.prompts), trace.sampling.max_new_tokens
    files = {}
    for f in sorted(root.iterdir()):
        m = LOG_RE.match(f.name)
        if m:
            step = int(m.group(1))
            if step in files:
                raise SimulationError(f"{root}: step {step} has two log files ({files[step].name}, {f.name}); "
                                      f"keep one per step")
            files[step] = f
    if not files:
        raise SimulationError(f"{root} holds neither a trace (no {MANIFEST}) nor rollout logs (no "
                              f"step_<N>.jsonl / step_<N>.parquet files); expected {LOG_LAYOUT}")
    steps, prompts = {}, {}
    for step, f in sorted(files.items()):
        df = pd.read_parquet(f) if f.suffix == ".parquet" else _read_jsonl(f)
        missing = [c for c in LOG_COLUMNS if c not in df.columns]
        if missing:
            raise SimulationError(f"{f} lacks columns {missing}; each log row needs {list(LOG_COLUMNS)} "
                                  f"(optional: prompt_token_ids, logprobs, reward)")
        df = df.assign(prompt_id=df["prompt_id"].astype(str))
        if "prompt_token_ids" in df:
            for pid, ids in zip(df["prompt_id"], df["prompt_token_ids"]):
                if ids is not None and pid not in prompts:
                    prompts[pid] = [int(t) for t in ids]
        steps[step] = df
    return steps, prompts, None


def checkpoint_steps(path: str | Path) -> list[int] | None:
    """The steps a replay of the trace at ``path`` runs (those with a checkpoint); None for logs."""
    from bench.traces.format import MANIFEST, Trace
    root = Path(path)
    if not (root / MANIFEST).exists():
        return None
    return [s.step for s in Trace.load(root, validate=False).steps if s.checkpoint is not None]


def _read_jsonl(path: Path) -> pd.DataFrame:
    return pd.DataFrame.from_records([r for _, r in iter_jsonl(path, SimulationError)])


# ---------------------------------------------------------------- a synthetic log

def synthetic_log(steps: int = 8, prompts: int = 16, samples: int = 8, max_len: int = 4096,
                  vocab: int = 151_936, median_len: int = 2048, event_rate: float = 0.03,
                  drift: float = 0.01, prompt_len: int = 128, eos: int = 2,
                  seed: int = 0) -> tuple[dict[int, pd.DataFrame], dict[str, list[int]]]:
    """A run log shaped like a real one, for scale checks: (rollouts by step, prompts).

    Every step visits the same ``prompts`` prompts with ``samples`` rollouts each (a GRPO group).
    Each prompt has a template (Zipf-distributed token ids over ``vocab``, twice ``max_len`` long)
    that drifts by ``drift`` substitutions per token and step (the policy moves); a rollout copies
    its template from the start and, at events of rate ``event_rate`` per token, substitutes a
    token, inserts 1-8 fresh ones, or jumps up to 64 tokens back or ahead, so rollouts of one
    prompt share long stretches (about 1 / event_rate tokens) with each other and with earlier
    steps, and rollouts of different prompts share only frequent tokens. Lengths are long-tailed:
    a per-prompt median (``median_len`` x lognormal(0, 0.5)) times lognormal(0, 0.5) per rollout,
    cut at ``max_len`` (finish_reason ``length``; the others end with ``eos``).
    """
    import numpy as np
    rng = np.random.default_rng(seed)
    perm = rng.permutation(vocab).astype(np.int32)
    zipf = lambda n: perm[(rng.zipf(1.2, n) - 1) % vocab]
    names = [f"p{i}" for i in range(prompts)]
    prompt_ids = {p: [int(t) for t in zipf(prompt_len)] for p in names}
    templates = {p: zipf(2 * max_len) for p in names}
    medians = {p: median_len * rng.lognormal(0.0, 0.5) for p in names}
    out = {}
    for step in range(steps):
        rows = []
        for p in names:
            tpl = templates[p]
            hit = rng.random(len(tpl)) < drift
            tpl[hit] = zipf(int(hit.sum()))
            for i in range(samples):
                n = int(min(max_len, max(16, medians[p] * rng.lognormal(0.0, 0.5))))
                parts, have, pos = [], 0, int(rng.integers(0, 16))
                while have < n:
                    take = min(int(rng.geometric(event_rate)), n - have)
                    parts.append(tpl[(pos + np.arange(take)) % len(tpl)])
                    pos, have = pos + take, have + take
                    r = rng.random()
                    if r < 0.5:  # substitution
                        parts.append(zipf(1))
                        pos, have = pos + 1, have + 1
                    elif r < 0.75:  # insertion
                        k = int(rng.integers(1, 9))
                        parts.append(zipf(k))
                        have += k
                    else:  # a jump: a stretch skipped or repeated
                        pos = max(0, pos + int(rng.integers(-64, 65)))
                toks = np.concatenate(parts)[:n]
                if n < max_len:
                    toks[-1] = eos
                rows.append((p, i, toks, prompt_ids[p], "length" if n >= max_len else "stop"))
        out[step] = pd.DataFrame(rows, columns=["prompt_id", "sample_idx", "token_ids", "prompt_token_ids",
                                                "finish_reason"])
    return out, prompt_ids


def write_log(steps: Mapping[int, pd.DataFrame], out_dir: str | Path) -> Path:
    """A folder of run logs (``step_<N>.parquet``) that ``load_input`` reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for step, df in steps.items():
        df.to_parquet(out / f"step_{step:05d}.parquet", index=False)
    return out


# ---------------------------------------------------------------- CLI

SHOW = ["method", "num_rollouts", "output_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
        "mean_acceptance_length", "acceptance_rate", "tokens_per_step", "draft_contribution",
        "cache_oracle_tokens_per_step", "cache_oracle"]
LEGEND = ("future_oracle: drafts each rollout's recorded future (knows what will be sampled), the bound of "
          "any drafter. cache_oracle_tokens_per_step: the best any copying drafter could do with the same "
          "cache contents as that method (cache_oracle: whose rollouts, in flight or finished only) under "
          "that method's draft budget; a bound for that method.")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input", type=Path, help="a trace directory or a folder of per-step rollout logs")
    ap.add_argument("--method", action="append", required=True,
                    help="a conf/method name, `future_oracle`, or `all` (every simulable method); repeatable; "
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
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        steps, prompts, max_new = load_input(args.input)
        names = [n for m in args.method for n in (simulable_methods() if m == "all" else [m])]
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
    except SimulationError as exc:
        sys.exit(f"bench.harness.simulate: {exc}")
    max_new = args.max_new_tokens or max_new or max(len(t) for df in steps.values() for t in df["token_ids"])
    n_rollouts = sum(len(df) for df in steps.values())
    n_tokens = sum(min(len(t), max_new) for df in steps.values() for t in df["token_ids"])
    print(f"{args.input}: {len(steps)} steps, {n_rollouts} rollouts, {n_tokens} tokens, "
          f"max_new_tokens {max_new} (loaded in {time.perf_counter() - t0:.1f}s)")
    t0 = time.perf_counter()
    rows = simulate(steps, prompts, cfgs, max_new, progress=True, policy=args.policy,
                    spec_max_rows=args.spec_max_rows, run_steps=run_steps, prices=prices, jobs=args.jobs)
    wall = time.perf_counter() - t0
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 30)
    table = summarize(rows)
    print(table[SHOW].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    per_step = summarize(rows, per_step=True)
    if targets:
        predicted = predictions(rows.attrs["iterations"], targets)
        _print_predictions(predicted)
        if prices is not None:
            print("(the policy's schedule was priced on a virtual clock: its drafter seconds are not timed, so these "
                  "predictions are forward passes only)")
        per_step = per_step.merge(_wide(predicted), on=["method", "step"], how="left")
        if args.figures:
            from bench.report.sim_figures import write_figures
            paths = write_figures(rows.attrs["iterations"], predicted, targets, args.figures)
            print(f"{len(paths)} figures in {args.figures}")
    if args.per_step:
        print(per_step[["step", *SHOW]].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(textwrap.fill(LEGEND, 110))
    parts = ", ".join(f"{k} {v:.1f}s" for k, v in rows.attrs.get("timings", {}).items())
    print(f"simulated {len(cfgs)} methods in {wall:.1f}s ({parts})")
    if args.out:
        _write(per_step, args.out)
    if args.rollouts_out:
        _write(rows, args.rollouts_out)
    if args.iterations_out:
        _write(rows.attrs["iterations"], args.iterations_out)


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
    # run the importable module's main, so config targets (bench.harness.simulate.RecordedOracle) are its classes
    from bench.core.errors import run_main
    from bench.harness.simulate import main as _main
    run_main(_main)
