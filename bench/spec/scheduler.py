"""The one speculation loop: every backend (torch_ref's model, the simulator's recorded tokens) is
driven through it, so every engine calls a drafter in the same order and counts the same way.

    pytest tests/test_scheduler.py tests/test_simulate.py     # the call order; simulator == engine

Per iteration the scheduler admits waiting rows (``start``), asks the speculation policy for a
cap, tells the drafter the live batch and that cap (``begin_iteration``), asks each row for a draft
(``propose``, budget = room left - 1), lets the policy choose the cap over the real drafts, tells a
drafter whose proposal was cut how much of it is verified (``verified``), splits the rows into one
or two forward passes, hands each to the backend (which runs the one verification rule and says
what the pass cost), cuts what was emitted at stop tokens and the room left (``settle``), counts,
feeds the emitted tokens back (``observe``), finishes each row as it ends (``finish``) and logs the
iteration. A backend only verifies: ``Backend`` below.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from methods.base import Draft, NO_DRAFT, Drafter, Rollout

from bench.core.drafting import (DraftCounters, drafts_mode, next_drafts, observe_all, refuse_feature_readers,
                                 settle_many, tell_verified)
from bench.core.engine_protocol import Request, RunAheadSource, request_key64
from bench.core.coupling import SamplingConfig
from bench.spec.policy import SpecPolicy
from bench.core.verdicts import Verdict, VerifyConfig, pass_nodes_read
from bench.spec.groups import forward_groups
from bench.spec.compiled_rows import compiled_settle_rows


@dataclass(slots=True)
class LiveRow:
    """A running rollout. ``pending`` are the tokens fed to the next pass besides its draft (the
    prompt, then the last emitted token) and ``cached`` the tokens before them whose KV is in place,
    so its context is ``cached + len(pending)`` on every backend. ``limit`` is the most tokens it
    may emit (``max_new_tokens``; the simulator: the recorded rollout's length) and ``final_reason``
    a finish reason the backend knows in advance (the simulator: the recorded one)."""

    request: Request
    key64: int
    pending: list[int]
    limit: int
    cached: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    counters: DraftCounters = field(default_factory=DraftCounters)
    first_t: float = 0.0
    last_t: float = 0.0
    finish_reason: str = ""
    final_reason: str = ""
    state: Any = None  # the backend's own per-row data

    @property
    def context(self) -> int:
        return self.cached + len(self.pending)

    def to_rollout(self) -> Rollout:
        r = self.request
        return Rollout(key=r.key, step=r.step, prompt_token_ids=list(r.prompt_token_ids), token_ids=self.output,
                       logprobs=self.logprobs, margins=self.margins, finish_reason=self.finish_reason,
                       **self.counters.as_dict(), first_token_time=self.first_t, last_token_time=self.last_t,
                       run_ahead=r.run_ahead, anticipates=r.anticipates)


@dataclass
class PassResult:
    """What a backend returns for one forward pass: one verdict per row of the pass (emitted
    tokens, accepted path, logprobs, margins) and the pass's forward and verifier seconds."""

    verdicts: list[Verdict]
    forward_s: float
    verify_s: float
    features: list | None = None  # per row, the policy's hidden state behind each emitted token (if kept)


class Backend(Protocol):
    """What verifies: torch_ref (``bench.engines.torch.engine``) and the simulator (``bench.harness.simulate``)."""

    def stops(self, sampling: SamplingConfig) -> set[int]: ...

    def fits(self, request: Request, sampling: SamplingConfig) -> bool: ...

    def start_call(self, sampling: SamplingConfig) -> None: ...

    def admit(self, rows: list[LiveRow], sampling: SamplingConfig) -> None: ...

    def forward(self, rows: list[LiveRow], group: list[int], drafts: list[Draft], sampling: SamplingConfig,
                verify: VerifyConfig) -> PassResult: ...

    def commit(self, rows: list[LiveRow], verdicts: list[Verdict]) -> None: ...

    def release(self, keep: list[int], rows: list[LiveRow]) -> None: ...

    # A backend that can hand drafters the policy's hidden states has ``keep_features`` (False until a
    # drafter that declares ``reads_features`` runs); its PassResult then carries ``features``.


@dataclass
class IterationState:
    """One iteration's decisions, kept apart from the rows: the policy's caps and what asking cost."""

    context_mean: float
    cap: int | None = None
    propose_s: float | None = None  # None: the drafter was not asked
    drafter_s: float = 0.0
    prefill: list[bool] = field(default_factory=list)  # per pass: prompt tokens in its block
    contexts: list[int] = field(default_factory=list)  # per row: its context before this iteration


def drain(steps):
    """Run a generator of iterations (``Scheduler.run``, ``TorchRefEngine.rollout_steps``) to its
    end and return what it returns: a rollout call that nothing interleaves."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def policy_name(drafter: Drafter) -> str:
    """The speculation policy's name for a drafter: its class and identity (two methods of one
    class keep their evidence apart)."""
    return f"{type(drafter).__name__}@{id(drafter):x}"


class Scheduler:
    """Drives one rollout call of one drafter over a backend; ``run`` yields after every iteration.

    ``iteration_log`` gets one dict per forward pass (what ``iterations.parquet`` stores).
    ``prices`` (``bench.spec.prices.TablePrices``): every pass costs its table price and nothing
    else does, on a virtual clock, instead of the seconds measured (see that module)."""

    def __init__(self, backend: Backend, policy: SpecPolicy, max_batch_size: int | None = None,
                 clock=time.perf_counter, prices=None):
        if prices is not None:
            from bench.spec.prices import VirtualClock
            clock = VirtualClock()
        self.backend, self.policy, self.max_batch_size, self.clock = backend, policy, max_batch_size, clock
        self.prices = prices
        self.iteration_log: list[dict] = []
        self.iterations = 0

    def run(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter, verify: VerifyConfig,
            run_ahead: RunAheadSource | None = None, limits: Sequence[int] | None = None):
        """A generator over the call's iterations; returns the trained rollouts in request order,
        then the run-ahead ones (finished or aborted). ``limits``: each request's most tokens
        (default ``sampling.max_new_tokens``). The call's clock stops while the generator is paused."""
        backend, policy = self.backend, self.policy
        stops = backend.stops(sampling)
        target = self.max_batch_size or len(requests)
        limit_of = {id(r): (sampling.max_new_tokens if limits is None else limits[i]) for i, r in enumerate(requests)}
        waiting = list(requests)
        rows: list[LiveRow] = []
        done: dict[int, Rollout] = {}
        ahead: list[Rollout] = []
        order = {id(r): i for i, r in enumerate(requests)}
        policy.start_call(policy_name(drafter))
        never = drafts_mode(drafter) == "never"
        self._hand_features(drafter)
        model_passes = getattr(drafter, "take_model_passes", None)  # a learned drafter's own passes
        if model_passes is not None:
            model_passes()  # counted before this call (a warm-up, a probe): not this call's
        backend.start_call(sampling)
        t0 = self.clock()
        while rows or waiting:
            t_iter = self.clock()
            drafter_s = self._admit(rows, waiting, target, sampling, drafter, run_ahead, limit_of)
            contexts = [r.cached + len(r.pending) for r in rows]
            state = IterationState(context_mean=sum(contexts) / len(rows), drafter_s=drafter_s, contexts=contexts)
            calls = self._iterate(rows, state, sampling, drafter, verify, stops, never, t0)
            drafter_s = state.drafter_s
            keep = []
            for i, row in enumerate(rows):
                if not row.finish_reason:
                    keep.append(i)
                    continue
                rollout = row.to_rollout()
                t_d = self.clock()
                drafter.finish(row.request.key, rollout)  # finished run-ahead rollouts feed caches too
                drafter_s += self.clock() - t_d
                if row.request.run_ahead:
                    ahead.append(rollout)
                else:
                    done[order[id(row.request)]] = rollout
            if len(keep) < len(rows):
                rows[:] = [rows[i] for i in keep]
                backend.release(keep, rows)
            total_s = self.clock() - t_iter
            self._log(calls, drafter_s, total_s, None if model_passes is None else model_passes())
            if policy.kind == "throughput_optimal" and not never:
                self._teach_policy(calls, state, total_s)
            if rows and not waiting and all(r.request.run_ahead for r in rows):
                for row in rows:  # the main batch is done: run-ahead rollouts are aborted
                    row.finish_reason = "abort"
                    ahead.append(row.to_rollout())
                break
            paused = self.clock()
            yield
            t0 += self.clock() - paused  # the call's clock stops while other calls run
        return [done[i] for i in range(len(requests))] + ahead

    def _hand_features(self, drafter: Drafter) -> None:
        """A drafter that reads the policy's hidden states gets them, or the call fails at once."""
        if not hasattr(self.backend, "keep_features"):
            refuse_feature_readers(drafter, type(self.backend).__name__)
            return
        self.backend.keep_features = bool(getattr(drafter, "reads_features", False))

    def _admit(self, rows, waiting, target, sampling, drafter, run_ahead, limit_of) -> float:
        """Waiting requests into free rows (run-ahead ones only into idle capacity); ``start`` each."""
        free = target - len(rows)
        admitted = [waiting.pop(0) for _ in range(min(free, len(waiting)))]
        if run_ahead is not None and not waiting and free - len(admitted) > 0 and rows:
            n = self.policy.run_ahead_rows(len(rows), free - len(admitted), sum(r.context for r in rows) / len(rows),
                                           trained_rows=sum(not r.request.run_ahead for r in rows))
            admitted += [r for r in run_ahead(n) if self.backend.fits(r, sampling)] if n else []
        if not admitted:
            return 0.0
        t_d = self.clock()
        for r in admitted:
            drafter.start(r.key, r.prompt_token_ids)
        drafter_s = self.clock() - t_d
        new = [LiveRow(r, request_key64(sampling.seed, r), list(r.prompt_token_ids),
                       limit_of.get(id(r), sampling.max_new_tokens)) for r in admitted]
        self.backend.admit(new, sampling)
        rows += new
        return drafter_s

    def _drafts(self, rows: list[LiveRow], state: IterationState, sampling: SamplingConfig, drafter: Drafter,
                never: bool) -> list[Draft]:
        """Each row's draft under the policy's caps (a first draft is verified in its row's prefill)."""
        policy = self.policy
        cap = 0 if never and policy.kind != "fixed" else policy.budget(len(rows), state.context_mean)
        first = [not row.output for row in rows]
        t_d = self.clock()
        if cap == 0 and not (any(first) and policy.first_drafts_decided and not never):
            state.cap = 0  # the policy drafts nothing now: the drafter is not asked (nor told the batch)
            state.drafter_s += self.clock() - t_d
            return [NO_DRAFT] * len(rows)
        hook = getattr(drafter, "begin_iteration", None)
        if hook is not None:
            hook([(row.request.key, len(row.output)) for row in rows], budget=cap)
        drafts = next_drafts(drafter, [row.request.key for row in rows], [row.output for row in rows],
                             sampling.max_new_tokens)
        state.drafter_s += self.clock() - t_d
        any_first = any(first)  # else (most iterations) every draft is a decoding one: nothing to split
        if cap != 0:  # asked for the first drafts only when budget said 0: the others stay undrafted
            cap = policy.choose([d for d, f in zip(drafts, first) if not f] if any_first else drafts,
                                state.context_mean, cap)
        first_cap = policy.choose_first([d for d, f in zip(drafts, first) if f] if any_first else [], len(rows),
                                        max(len(r.pending) for r in rows), state.context_mean, cap)
        state.propose_s = self.clock() - t_d  # what asking cost: the proposals and the choice over them
        state.cap = cap
        if cap is not None or first_cap is not None:
            capped = []
            for row, d, f in zip(rows, drafts, first):
                c = first_cap if f else cap
                if c is not None and len(d) > c:
                    tell_verified(drafter, row.request.key, c)
                    d = d.truncated(c)
                capped.append(d)
            drafts = capped
        return drafts

    def _iterate(self, rows: list[LiveRow], state: IterationState, sampling: SamplingConfig, drafter: Drafter,
                 verify: VerifyConfig, stops: set[int], never: bool, t0: float) -> list[dict]:
        """One iteration: draft, verify in one or two passes, commit; one log entry per pass."""
        drafts = self._drafts(rows, state, sampling, drafter, never)
        contexts = state.contexts
        draft_lens = [len(d.token_ids) for d in drafts]
        pending = [len(r.pending) for r in rows]
        sizes = [p + k for p, k in zip(pending, draft_lens)]
        ahead = any(r.request.run_ahead for r in rows)
        lookup = self.policy.lookup  # None without a table (or "auto" before load)
        by_table = None if lookup is None else (lambda r, q: lookup.one(r, q, state.context_mean))
        verdicts: list = [None] * len(rows)
        features: list | None = None  # per row, once a pass hands hidden states back
        calls = []
        groups = forward_groups(sizes, seconds=by_table)
        whole = len(groups) == 1  # the common case: every row, read off the iteration's lists
        for group in groups:
            g_drafts = drafts if whole else [drafts[i] for i in group]
            result = self.backend.forward(rows, group, g_drafts, sampling, verify)
            if whole:
                verdicts, features = result.verdicts, result.features
            else:
                for i, v in zip(group, result.verdicts):
                    verdicts[i] = v
                if result.features is not None:
                    features = features or [None] * len(rows)
                    for j, i in enumerate(group):
                        features[i] = result.features[j]
            ctx = contexts if whole else [contexts[i] for i in group]
            g_sizes = sizes if whole else [sizes[i] for i in group]
            widest, queries = max(g_sizes), sum(g_sizes)
            if self.prices is not None:  # the table's price of this shape, and nothing for the verifier
                result = PassResult(result.verdicts, self.prices(len(group), widest, sum(ctx) / len(group), queries),
                                    0.0)
                self.clock.advance(result.forward_s)
            calls.append({"rows": len(group),
                          "run_ahead_rows": sum(rows[i].request.run_ahead for i in group) if ahead else 0,
                          "query_tokens": queries, "block_tokens": len(group) * widest, "context_sum": sum(ctx),
                          "context_max": max(ctx),
                          "draft_tokens": sum(draft_lens) if whole else sum(draft_lens[i] for i in group),
                          "draft_budget": -1 if state.cap is None else state.cap, "group": group,
                          "prefill": (max(pending) if whole else max(pending[i] for i in group)) > 1,
                          "tree_block": widest > 1 and any(d.parents is not None for d in g_drafts),  # an ancestor mask
                          "forward_s": result.forward_s, "verify_s": result.verify_s})
        now = self.clock() - t0
        self.backend.commit(rows, verdicts)
        records = self.policy.kind == "throughput_optimal"
        settled = self._settle_all(rows, drafts, draft_lens, verdicts, stops, now, records)
        self._feed_back(rows, settled, features, drafter, state)
        state.prefill = [call.pop("prefill") for call in calls]
        ratio = verify.rule == "ratio"
        for call in calls:
            group = call.pop("group")
            call["accepted_tokens"] = sum(s[1] for s in settled) if whole else sum(settled[i][1] for i in group)
            call["nodes_read"] = pass_nodes_read(draft_lens if whole else [draft_lens[i] for i in group],
                                                 (verdicts[i].path for i in group), ratio=ratio)
        return calls

    def _settle_all(self, rows: list[LiveRow], drafts: list[Draft], draft_lens: list[int], verdicts: list[Verdict],
                    stops: set[int], now: float, records: bool) -> list[tuple[list[int], int]]:
        """Cut every row's verdict at stops and its room, count it, append it to the row (``records``:
        show the policy what was accepted); per row, the tokens kept and how many were accepted.
        Compiled (``bench.spec.compiled_rows``) where built and nothing is recorded, else
        :meth:`_settle_all_python`."""
        if compiled_settle_rows is not None and not records:
            return compiled_settle_rows(rows, draft_lens, verdicts, stops, float(now))
        return self._settle_all_python(rows, drafts, draft_lens, verdicts, stops, now, records)

    def _settle_all_python(self, rows: list[LiveRow], drafts: list[Draft], draft_lens: list[int],
                           verdicts: list[Verdict], stops: set[int], now: float,
                           records: bool) -> list[tuple[list[int], int]]:
        """The reference of :meth:`_settle_all`, in one loop (the compiled form equals it)."""
        kept = settle_many([row.counters for row in rows], draft_lens, [v.emitted for v in verdicts],
                           [len(v.path) - 1 for v in verdicts], stops, [len(row.output) for row in rows],
                           [row.limit for row in rows])
        record = self.policy.record
        settled = []
        for row, d, draft_len, v, (n, accepted, reason) in zip(rows, drafts, draft_lens, verdicts, kept):
            emitted, lps, mgs = v.emitted, v.logprobs, v.margins
            row.cached += len(row.pending) + len(v.path) - 1
            if n < len(emitted):
                emitted, lps, mgs = emitted[:n], lps[:n], mgs[:n]
            output = row.output
            if records and draft_len:  # a first draft (output length 0, verified in the prefill) is no
                # evidence for the drafts of decoding: it has a tracker of its own
                record(draft_len, accepted, None if d.parents is None else [j - 1 for j in v.path[1:1 + accepted]],
                       d.parents, first=not output)
            if not output:
                row.first_t = now
            output += emitted
            row.logprobs += lps
            if mgs:
                row.margins += mgs
            row.last_t = now
            if emitted:
                row.pending = [emitted[-1]]
            if reason:
                row.finish_reason = row.final_reason or reason
            elif not emitted:  # nothing left to emit (an empty recorded rollout)
                row.finish_reason = row.final_reason or "stop"
            settled.append((emitted, accepted))
        return settled

    def _feed_back(self, rows: list[LiveRow], settled: list[tuple[list[int], int]], features: list | None,
                   drafter: Drafter, state: IterationState) -> None:
        """Every row's kept tokens to the drafter, in row order (the hidden states behind them first,
        to a drafter that reads them): one clock reading for the whole batch."""
        t_d = self.clock()
        if features is None:  # no hidden states kept (every drafter but a feature reader)
            observe_all(drafter, [row.request.key for row in rows], [s[0] for s in settled])
        else:
            observe = drafter.observe
            for row, (emitted, _), f in zip(rows, settled, features):
                if f is not None and emitted:
                    drafter.observe_features(row.request.key, f[:len(emitted)])
                observe(row.request.key, emitted)
        state.drafter_s += self.clock() - t_d

    def _log(self, calls: list[dict], drafter_s: float, total_s: float, model: dict | None = None) -> None:
        """Append an iteration's passes to ``iteration_log``; the drafter's seconds and the rest of
        the iteration go on its first pass, with a learned drafter's own passes (``model``, the
        ``drafter_model_*`` counts of ``bench.drafters.model_passes``)."""
        live = sum(c["rows"] for c in calls)
        other = total_s - drafter_s - sum(c["forward_s"] + c["verify_s"] for c in calls)
        for j, call in enumerate(calls):
            call.update(iteration=self.iterations, call=j, live_rows=live,
                        drafter_s=drafter_s if j == 0 else 0.0, other_s=max(other, 0.0) if j == 0 else 0.0)
            if model is not None:
                call.update(model if j == 0 else dict.fromkeys(model, 0))
            self.iteration_log.append(call)
        self.iterations += 1

    def _teach_policy(self, calls: list[dict], state: IterationState, total_s: float) -> None:
        """throughput_optimal learns this iteration's seconds: each pass's shape and forward seconds,
        the verifier's, what asking the drafter cost and the rest (host)."""
        fwd, ver = sum(c["forward_s"] for c in calls), sum(c["verify_s"] for c in calls)
        shapes = [(c["rows"], c["block_tokens"] // c["rows"], c["query_tokens"], c["forward_s"],
                   "prefill" if prefill else "drafted" if c["draft_tokens"] else "plain")
                  for c, prefill in zip(calls, state.prefill)]
        self.policy.record_iteration(shapes, state.context_mean, ver, state.propose_s,
                                     total_s - fwd - ver - (state.propose_s or 0.0))
