"""The simulator's replay: recorded rollouts through drafters by the engine's own scheduler, no
model, so each method's counters and iteration log are what exact verification would give.

    python -m bench.harness.simulate TRACE_OR_LOG_DIR --method tree_cache --jobs 2   # the command over this
    pytest tests/test_simulate.py -k engine                                         # simulator == torch_ref

A recorded token is a sample of the target policy, so the draft tokens that match a rollout's
recorded continuation are exactly what exact verification would accept. Each step's rollouts form
one batch, driven by the engine's own scheduler (``bench.spec.scheduler``) over the recorded-tokens
backend (``bench.spec.recorded``): the same calls in the same order, the same caps and forward
passes, the same counters and iteration log as a torch_ref replay of the same steps
(``tests/test_simulate.py`` checks the equality), so ``bench.report.stats`` applies as is. Beside
each method's counters go the forward passes of its cache oracle (``bench.harness.sim_cache_oracle``).
"""
from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Any, Mapping, NamedTuple, Sequence

import pandas as pd
from tqdm.auto import tqdm

from methods.base import Rollout

from bench.core.engine_protocol import Request
from bench.core.coupling import SamplingConfig
from bench.core.verdicts import VerifyConfig
from bench.spec.policy import SpecPolicy
from bench.spec.recorded import Recorded, RecordedBackend, feed_finished, recorded_rows
from bench.spec.scheduler import Scheduler, drain
from bench.harness.sim_cache_oracle import CacheBound, cache_bound, oracle_passes
from bench.harness.sim_methods import RecordedOracle, SimulationError, build_drafter, check_simulable

SIM_POLICIES = ("fixed", "batch_threshold", "throughput_optimal")
ROW_COLUMNS = ("method", "step", "prompt_id", "sample_idx", "output_len", "num_drafts", "num_draft_tokens",
               "num_accepted_tokens", "num_accepted_tokens_per_pos", "num_forward_passes",
               "cache_oracle_num_forward_passes", "cache_oracle", "finish_reason", "reward")


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
    return drain(scheduler.run(requests, SamplingConfig(max_new_tokens=max_new_tokens), drafter, VerifyConfig()))


def simulate(rollouts_by_step: Mapping[int, pd.DataFrame], prompts: Mapping[str, list[int]],
             method_cfgs: Mapping[str, Any], max_new_tokens: int, progress: bool = False,
             policy: str = "fixed", spec_max_rows: int = 32, run_steps: Sequence[int] | None = None,
             prices=None, jobs: int = 1, cache_oracles: bool = True) -> pd.DataFrame:
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
    together in the order of ``method_cfgs``: the same frame as a serial run's; each distinct cache
    oracle is a task of its own, run once). ``cache_oracles=False``: the oracle columns hold 0 passes
    (their ``cache_oracle`` label still set) and no oracle runs.
    """
    _check_options(max_new_tokens, policy, prices)
    run = sorted(rollouts_by_step) if run_steps is None else sorted(run_steps)
    fed = _fed_steps(rollouts_by_step, run)
    for name, cfg in method_cfgs.items():  # refuse before anything runs
        if not hasattr(cfg, "propose"):
            check_simulable(name, cfg)
    if jobs < 1:
        raise SimulationError(f"jobs must be >= 1, got {jobs}")
    if jobs > 1 and len(method_cfgs) > 1:
        return _in_processes(rollouts_by_step, prompts, method_cfgs, max_new_tokens, progress, jobs,
                             dict(policy=policy, spec_max_rows=spec_max_rows, run_steps=run_steps, prices=prices),
                             cache_oracles)
    settings = _Settings(rollouts_by_step, prompts, max_new_tokens, run, fed, policy, spec_max_rows, prices, progress)
    with _few_collections():
        return _serial(settings, method_cfgs, cache_oracles)


@contextmanager
def _few_collections():
    """Python's cycle collector, nearly out of the way while methods replay: what exists now (the
    recorded rollouts, millions of token lists) is frozen out of its scans, and it runs after 50,000
    new containers instead of 700. At 1,024 rows of up to 4,096 tokens its scans were 60% of a
    baseline replay (27.9 s against 11.6 s; results/LOG.md, 2026-12-06); the replay makes few cycles,
    and they are still collected."""
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, threshold[1], threshold[2])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def _serial(settings: "_Settings", method_cfgs: Mapping[str, Any], cache_oracles: bool = True) -> pd.DataFrame:
    """Every method in this process, one after another (``simulate``'s settings)."""
    rollouts_by_step, prompts, max_new_tokens = settings.rollouts_by_step, settings.prompts, settings.max_new_tokens
    oracles: dict[CacheBound, dict] = {}
    timings: dict[str, float] = {}
    iterations: list[dict] = []
    frames = []
    for name, cfg in method_cfgs.items():
        drafter = build_drafter(name, cfg)  # one at a time: a drafter's caches go when it is done
        bound = _engine_capped_bound(drafter, max_new_tokens)
        if cache_oracles and bound is not None and bound not in oracles:
            t0 = time.perf_counter()
            oracles[bound] = _oracle(rollouts_by_step, prompts, max_new_tokens, bound)
            timings[f"cache oracle [{bound.label()}]"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out, log = _method_rows(settings, name, drafter, bound, oracles.get(bound, {}))
        timings[name] = time.perf_counter() - t0
        iterations += log
        del drafter
        frames.append(pd.DataFrame(out, columns=list(ROW_COLUMNS)))
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(ROW_COLUMNS))
    rows.attrs["timings"] = timings
    rows.attrs["iterations"] = pd.DataFrame(iterations)
    return rows


class _Settings(NamedTuple):
    """What every method of one ``simulate`` call replays, and how."""

    rollouts_by_step: Mapping[int, pd.DataFrame]
    prompts: Mapping[str, list[int]]
    max_new_tokens: int
    run: list[int]  # the simulated steps, in order
    fed: dict[int, list[int]]  # per simulated step, the steps fed before it (``_fed_steps``)
    policy: str
    spec_max_rows: int
    prices: Any
    progress: bool


def _check_options(max_new_tokens: int, policy: str, prices) -> None:
    if max_new_tokens < 1:
        raise SimulationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if policy not in SIM_POLICIES:
        raise SimulationError(f"policy {policy!r} is not a speculation policy: use one of {SIM_POLICIES}")
    if policy == "throughput_optimal" and prices is None:
        raise SimulationError("policy throughput_optimal decides from seconds: give one price target (--table CSV "
                              "or --predict HARDWARE:MODEL)")


def _fed_steps(rollouts_by_step: Mapping[int, pd.DataFrame], run: list[int]) -> dict[int, list[int]]:
    """Per simulated step, the recorded steps not simulated that come before it (and after the
    simulated step before it): fed to the drafters as finished rollouts just before it."""
    missing = [s for s in run if s not in rollouts_by_step]
    if missing:
        raise SimulationError(f"steps {missing} have no recorded rollouts; recorded steps: {sorted(rollouts_by_step)}")
    return {s: [f for f in sorted(rollouts_by_step) if f not in run and f < s and (i == 0 or f > run[i - 1])]
            for i, s in enumerate(run)}


def _oracle(rollouts_by_step, prompts, max_new_tokens: int, bound: CacheBound) -> dict[tuple[int, str, int], int]:
    return oracle_passes(rollouts_by_step, max_new_tokens, bound.in_flight, bound.budget, bound.scope, prompts)


def _engine_capped_bound(drafter, max_new_tokens: int) -> CacheBound | None:
    """``cache_bound(drafter)``, its budget dropped where the engine's is the tighter one everywhere."""
    bound = cache_bound(drafter)
    if bound is not None and bound.budget is not None and bound.budget >= max_new_tokens - 1:
        bound = bound._replace(budget=None)
    return bound


def _method_rows(s: _Settings, name: str, drafter, bound: CacheBound | None,
                 passes: Mapping[tuple[int, str, int], int]) -> tuple[list[tuple], list[dict]]:
    """One method's per-rollout rows (``ROW_COLUMNS``) over the simulated steps, and its iteration log."""
    label = "" if bound is None else bound.label()
    out: list[tuple] = []
    iterations: list[dict] = []
    spec = SpecPolicy(s.policy, s.spec_max_rows, None if s.prices is None else s.prices.table)
    for step in tqdm(s.run, desc=f"simulate {name}", disable=not s.progress):
        for f in s.fed[step]:
            feed_finished(drafter, f, recorded_rows(s.rollouts_by_step[f], s.max_new_tokens, cut=False), s.prompts)
        rows = recorded_rows(s.rollouts_by_step[step], s.max_new_tokens)
        log: list[dict] = []
        done = run_step(drafter, step, rows, s.prompts, s.max_new_tokens, policy=spec, prices=s.prices,
                        iteration_log=log)
        iterations += [{"method": name, "step": step, **c} for c in log]
        out += [(name, step, r.key.prompt_id, r.key.sample_idx, len(r.tokens), o.num_drafts,
                 o.num_draft_tokens, o.num_accepted_tokens, o.num_accepted_tokens_per_pos,
                 o.num_forward_passes, passes.get((step, r.key.prompt_id, r.key.sample_idx), 0), label,
                 r.finish_reason, r.reward)
                for r, o in zip(rows, done)]
    return out, iterations


_SHARED: tuple = ()  # (rollouts_by_step, prompts) for forked workers: inherited, never pickled per task


def _one_method(name, cfg, max_new_tokens, options) -> pd.DataFrame:
    rollouts_by_step, prompts = _SHARED
    return simulate(rollouts_by_step, prompts, {name: cfg}, max_new_tokens, False, cache_oracles=False, **options)


def _one_oracle(bound: CacheBound, max_new_tokens: int) -> tuple[dict, float]:
    rollouts_by_step, prompts = _SHARED
    t0 = time.perf_counter()
    return _oracle(rollouts_by_step, prompts, max_new_tokens, bound), time.perf_counter() - t0


def _in_processes(rollouts_by_step, prompts, method_cfgs, max_new_tokens, progress, jobs, options,
                  cache_oracles: bool = True) -> pd.DataFrame:
    """``simulate`` with one method per worker process, ``jobs`` at a time, put back in method order,
    and each distinct cache oracle as a task of its own (once, however many methods share it; its
    passes filled into their rows here). Workers are forked where the platform allows, so the
    recorded rollouts are shared, not copied per task; a method's drafter seconds are measured
    under the others' load."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    global _SHARED
    methods = list(method_cfgs)
    bounds = ({name: _engine_capped_bound(build_drafter(name, method_cfgs[name]), max_new_tokens) for name in methods}
              if cache_oracles else {})  # a drafter is built to read its bound, then dropped
    distinct = list(dict.fromkeys(b for b in bounds.values() if b is not None))
    fork = "fork" in multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if fork else "spawn")
    parts: dict[str, pd.DataFrame] = {}
    oracles: dict[CacheBound, tuple[dict, float]] = {}
    _SHARED = (rollouts_by_step, prompts)
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(methods) + len(distinct)), mp_context=context,
                                 initializer=None if fork else _share, initargs=() if fork else _SHARED) as pool:
            futures = {pool.submit(_one_method, name, method_cfgs[name], max_new_tokens, options): name
                       for name in methods}
            futures.update({pool.submit(_one_oracle, b, max_new_tokens): b for b in distinct})
            for future in tqdm(as_completed(futures), total=len(futures), desc=f"simulate ({jobs} jobs)",
                               disable=not progress):
                (parts if isinstance(futures[future], str) else oracles)[futures[future]] = future.result()
    finally:
        _SHARED = ()
    frames = [parts[name] for name in methods]
    timings: dict[str, float] = {}
    for b in distinct:
        timings[f"cache oracle [{b.label()}]"] = oracles[b][1]
    for name, frame in zip(methods, frames):
        if bounds.get(name) is not None:
            passes = oracles[bounds[name]][0]
            frame["cache_oracle_num_forward_passes"] = [
                passes.get((s, p, i), 0) for s, p, i in zip(frame["step"], frame["prompt_id"], frame["sample_idx"])]
        timings.update(frame.attrs["timings"])
    rows = pd.concat(frames, ignore_index=True)
    rows.attrs["timings"] = timings
    rows.attrs["iterations"] = pd.concat([f.attrs["iterations"] for f in frames], ignore_index=True)
    return rows


def _share(rollouts_by_step, prompts) -> None:
    """A spawned worker's copy of the data (where fork is not available)."""
    global _SHARED
    _SHARED = (rollouts_by_step, prompts)
