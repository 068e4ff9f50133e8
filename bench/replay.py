"""The harness loop: replay a recorded RL run, steps x methods, on one engine.

For each step it loads that step's checkpoint, runs every method's rollouts of the step's prompts
(n samples each) through the engine with the method's drafter and verify rule, lets the drafter
keep its caches, and appends one crash-safe results unit per (step, method). A rerun of a killed
run skips the finished units and rebuilds each drafter's caches from the rollouts it already
wrote, so nothing is lost or counted twice.   python -m bench.cli   (see conf/bench.yaml)
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd
from tqdm.auto import tqdm

from methods.base import Drafter, NullDrafter, Rollout, RolloutKey

from .engines.base import Engine, Request
from .results import RunWriter, rollout_row, step_row
from .sampling import SamplingConfig
from .trace import Trace
from .verify import VerifyConfig


@dataclass
class MethodSpec:
    """A method as the harness runs it: a drafter factory, a verify rule, run-ahead or not."""

    name: str
    make_drafter: Callable[[], Drafter]
    verify: VerifyConfig
    run_ahead: bool = False


def step_requests(trace: Trace, step: int, n: int, run_ahead: bool = False) -> list[Request]:
    """The n-sample group of every prompt of a step, in the trace's prompt order."""
    return [Request(RolloutKey(pid, i), trace.prompts[pid], step, run_ahead)
            for pid in trace.step(step).prompt_ids for i in range(n)]


class RunAheadQueue:
    """SRT's run-ahead: rollouts of the prompts due at the next step, handed to the engine when its
    batch shrinks; their tokens only feed the drafter's caches."""

    def __init__(self, requests: list[Request]):
        self.pending = list(requests)

    def __call__(self, free: int) -> list[Request]:
        take, self.pending = self.pending[:free], self.pending[free:]
        return take


def warm_drafter(drafter: Drafter, step: int, rows: pd.DataFrame, prompts: dict[str, list[int]]) -> None:
    """Feed a drafter the rollouts it produced at a finished step (resume without the model):
    the same start/observe/finish calls the engine made, with each rollout observed whole.
    Run-ahead rollouts are not stored, so a resumed run-ahead method misses their tokens."""
    drafter.begin_step(step)
    rows = rows[~rows["run_ahead"].fillna(False).astype(bool)] if "run_ahead" in rows else rows
    keys = [RolloutKey(str(p), int(s)) for p, s in zip(rows["prompt_id"], rows["sample_idx"])]
    for key in keys:
        drafter.start(key, prompts[key.prompt_id])
    for key, r in zip(keys, rows.itertuples(index=False)):
        tokens = [int(t) for t in r.output_tokens]
        drafter.observe(key, tokens)
        drafter.finish(key, Rollout(key, step, prompts[key.prompt_id], tokens,
                                    [float(x) for x in r.logprobs], r.finish_reason))


def replay(trace: Trace, engine: Engine, methods: list[MethodSpec], sampling: SamplingConfig,
           writer: RunWriter, steps: list[int] | None = None, n: int | None = None,
           labels: dict[str, Any] | None = None, progress: bool = True,
           finished_rows: Callable[[int, str], pd.DataFrame] | None = None) -> None:
    """Replay ``steps`` (default: all) of ``trace`` with every method; results go to ``writer``."""
    steps = list(steps if steps is not None else trace.step_numbers)
    n = n or trace.sampling.n
    labels = dict(labels or {})
    drafters = {m.name: m.make_drafter() for m in methods}
    done = writer.done_units()
    bar = tqdm(steps, desc="replay", disable=not progress, unit="step")
    warmed = False
    for i, step in enumerate(bar):
        todo = [m for m in methods if (step, m.name) not in done]
        for m in methods:
            if m not in todo and finished_rows is not None:
                warm_drafter(drafters[m.name], step, finished_rows(step, m.name), trace.prompts)
        if not todo:
            continue
        engine.load(trace.checkpoint(step))
        requests = step_requests(trace, step, n)
        if not warmed:  # one throwaway call so one-time costs (allocator, kernels) hit no method's clock
            engine.rollout(requests[:1], sampling, NullDrafter(), VerifyConfig())
            warmed = True
        recorded = _recorded_tokens(trace, step)
        next_step = steps[i + 1] if i + 1 < len(steps) else None
        shift = i % len(todo)  # rotate the order so no method is always first after a checkpoint swap
        for m in todo[shift:] + todo[:shift]:
            bar.set_postfix_str(f"step {step}: {m.name}")
            drafter = drafters[m.name]
            drafter.begin_step(step)
            if hasattr(drafter, "reset_stats"):
                drafter.reset_stats()  # counters per step; cache sizes are state and stay
            run_ahead = None
            if m.run_ahead and next_step is not None:
                run_ahead = RunAheadQueue(step_requests(trace, next_step, n, run_ahead=True))
            gc.collect()  # a collector pause belongs to no method's clock
            t0 = time.perf_counter()
            rollouts = engine.rollout(requests, sampling, drafter, m.verify, run_ahead=run_ahead)
            wall = time.perf_counter() - t0
            rows = [rollout_row(r, **labels, method=m.name,
                                reward=trace.reward(r.key.prompt_id, r.token_ids) if trace.has_reward else None,
                                matches_recorded=None if recorded is None else
                                recorded.get((r.key.prompt_id, r.key.sample_idx)) == r.token_ids)
                    for r in rollouts]
            stats = drafter.stats() if hasattr(drafter, "stats") else {}
            srow = step_row(rows, wall, getattr(engine, "last_iterations", max(r.num_forward_passes for r in rollouts)),
                            cache_entries=stats.get("cache_entries", stats.get("sequences")),
                            cache_bytes=stats.get("cache_bytes"), drafter_stats=stats, **labels)
            writer.write_unit(step, m.name, rows, srow)
    writer.finish()


def _recorded_tokens(trace: Trace, step: int) -> dict[tuple[str, int], list[int]] | None:
    df = trace.rollouts(step)
    if df is None:
        return None
    return {(str(p), int(s)): [int(t) for t in toks] for p, s, toks in
            zip(df["prompt_id"], df["sample_idx"], df["token_ids"])}
