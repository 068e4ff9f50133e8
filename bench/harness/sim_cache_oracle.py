"""The cache oracle beside every simulated method: the best any copying drafter could do with the
same cache contents as that method, under that method's draft budget (a bound for that method).

    python -m bench.harness.simulate TRACE_DIR --method tree_cache     # its cache_oracle columns
    python -m bench.benchmarks simulate-scale                          # every distinct cache oracle, timed
    pytest tests/test_simulate.py -k cache_oracle                      # the bound holds, per rollout

``cache_oracle_tokens_per_step`` (a column beside every method) is that bound; it is not the
future oracle (``--method future_oracle``, ``bench.harness.sim_methods.RecordedOracle``), which
knows the future whatever its cache. At each iteration a row's accepted length is the longest
prefix of its remaining recorded tokens, capped by the budget, that occurs as a contiguous run
anywhere in the cache texts at that moment; the row advances by that plus the bonus token (its own
iteration, so the oracle's siblings advance at the oracle's pace: they are never behind the
method's, so its cache holds at least the method's). The ``cache_oracle`` column names the cache
and the budget (``cache_bound``): ``prompt`` caches hold the same prompt's recorded rollouts
finished before that iteration (all earlier steps, and siblings of this step that already
finished, as a finish-time history cache holds them), plus, ``in flight``, the tokens emitted so
far this step by the prompt's running rollouts (its own included); ``all prompts`` (suffix_global,
and any drafter the table does not know) holds every rollout's prompt and response, in flight.
The budget is the method's ``max_spec_tokens`` (each draft also fits the engine's
``max_new_tokens - len(output) - 1``). The texts live in a suffix automaton
(``methods.oracle.SuffixAutomaton``), linear in the tokens whatever the budget.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

import pandas as pd

from methods.base import RolloutKey
from methods.baseline import Baseline
from methods.history_spec import HistorySpecDrafter
from methods.hybrid import HybridDrafter
from methods.oracle import SuffixAutomaton
from methods.suffix.compiled import CompiledAutomaton
from methods.prefix_reuse import PrefixReuseDrafter
from methods.suffix_global import SuffixGlobalDrafter
from methods.tree_cache import TreeCacheDrafter

from bench.spec.recorded import recorded_rows
from bench.harness.sim_methods import RecordedOracle


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
    # the compiled suffix automaton where it was built (the same walk, about 10x faster; depth 1:
    # its counts are not read here)
    new_cache = SuffixAutomaton if CompiledAutomaton is None else (lambda: CompiledAutomaton(1, counts=False))
    passes: dict[tuple[int, str, int], int] = {}
    seq = 0
    for step in sorted(rollouts_by_step):
        rows = [_OracleRow(r.key, r.tokens) for r in recorded_rows(rollouts_by_step[step], max_new_tokens)]
        ids, cache = {}, {}
        for r in rows:
            pid = r.key.prompt_id
            name = pid if scope == "prompt" else ""
            if name not in caches:
                caches[name] = new_cache()
            cache[r.key] = caches[name]
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
