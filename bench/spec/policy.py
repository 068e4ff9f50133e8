"""Speculation policies: how many draft tokens each row may verify this iteration, for every method.

    python -m bench.harness.cli engine.spec_policy=throughput_optimal     # see conf/engine/torch_ref.yaml
    python -m pytest -q tests/test_spec_policy.py tests/test_latency.py

A policy is an engine knob, not a method's: from the live batch and the acceptance seen so far it
caps the draft budget of an iteration (or says not to ask the drafter at all), sizes first drafts,
and admits run-ahead rollouts. It never touches what is emitted, so exact methods stay
token-identical to the baseline under every policy (tests/test_latency.py).

- ``fixed``: the method's own budget (the default).
- ``batch_threshold``: no drafts while more than ``max_rows`` rows are live.
- ``throughput_optimal``: the budget that maximises expected tokens per second of the whole
  iteration, from the latency table (``bench/spec/policy_table.py``) scaled to the machine now and
  the other seconds fitted to this call (``bench/spec/policy_costs.py``), and the acceptance of
  each draft node (``bench/spec/policy_acceptance.py``).

Why it decides the way it does (the cost model, probes, first drafts, what carries between calls):
docs/policies.md.
"""
from __future__ import annotations

import copy
from typing import Sequence

from bench.spec.policy_acceptance import AcceptanceTracker, aged
from bench.spec.policy_costs import PLAIN_PRIOR_PASSES, CostModel
from bench.spec.policy_table import TableLookup

POLICIES = ("fixed", "batch_threshold", "throughput_optimal")
CANDIDATE_BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
REDECIDE = 8  # throughput_optimal: budget() decides again when the live rows change or after this many iterations
RUN_AHEAD_SLACK = 0.05  # throughput_optimal: run-ahead rows only while they add at most 5% to an iteration
DECAY = 0.8  # throughput_optimal: acceptance evidence weighs this much less with every iteration (about 5 iterations' memory)
PROBE_AFTER = 16  # throughput_optimal: after this many iterations without a verified draft, probe ...
PROBE_SLACK = 0.25  # ... if its pass costs at most 25% more than a plain one: at most 25% / 16 = 1.6% lost if probes never pay
FIRST_DECAY = 0.5  # throughput_optimal: first drafts' acceptance of earlier calls weighs half as much each call


class SpecPolicy:
    """Caps each iteration's draft budget; ``budget`` None means no cap (the method's own)."""

    def __init__(self, kind: str = "fixed", max_rows: int = 32, table=None):
        if kind not in POLICIES:
            raise ValueError(f"engine.spec_policy must be one of {POLICIES}, got {kind!r}")
        if kind == "batch_threshold" and max_rows < 0:
            raise ValueError(f"engine.spec_max_rows must be >= 0, got {max_rows}")
        if kind == "throughput_optimal" and table is None:
            raise ValueError("engine.spec_policy=throughput_optimal needs a latency table: set "
                             "engine.latency_table=auto (profiled once per model and machine) or a CSV "
                             "path written by python -m bench.benchmarks latency profile")
        self.kind, self.max_rows = kind, max_rows
        self.table = table  # "auto" until the engine has loaded its model and profiled (or read) its table
        self.tracker = AcceptanceTracker()
        self.costs = CostModel()
        self._priors: dict[str, CostModel] = {}  # per drafter (``who``): its last call's host/drafter fits
        self.first = AcceptanceTracker()  # first drafts' acceptance: carried between calls of a drafter
        self._first_priors: dict[str, AcceptanceTracker] = {}
        self._plain_prior = 1.0  # the plain passes' scale of the last call that logged enough of them
        self._who = ""
        self._last = None
        self._idle = 0  # iterations since a draft was last verified
        self._probe = 0  # the budget of a probe asked this iteration (0: none)

    @property
    def table(self):
        return self._table

    @table.setter
    def table(self, table) -> None:
        self._table = table
        self.lookup = TableLookup(table) if hasattr(table, "query_seconds") else None

    def start_call(self, who: str = "") -> None:
        """A new rollout call (one step of one method); ``who`` names the drafter (the engine: its
        class and identity, so two methods of one class, say prefix_reuse under the lossy and the
        exact rule, keep their evidence apart)."""
        if self._who:
            self._priors[self._who] = self.costs
            self._first_priors[self._who] = self.first
        self._who = who
        prior = self._priors.get(who)
        self.tracker = AcceptanceTracker()
        self.first = aged(self._first_priors.get(who), FIRST_DECAY)
        self.costs = prior.carried(self._plain_prior) if prior else CostModel(prior=self._plain_prior)
        self._last = None  # (live rows, budget, iterations it has stood) of the last decision
        self._idle = self._probe = 0

    def carried(self, who: str):
        """What the next call of drafter ``who`` starts from (its last call's fits and first-draft
        acceptance; None, None before any call), as a copy: a timing repeat of a unit puts it back
        with ``restore_carried`` before each repeat, so every repeat decides from the same evidence."""
        if who == self._who:
            return copy.deepcopy((self.costs, self.first))
        return copy.deepcopy((self._priors.get(who), self._first_priors.get(who)))

    def restore_carried(self, who: str, state) -> None:
        """Make ``state`` (from ``carried``) what the next call of ``who`` starts from."""
        if self._who:  # the call in progress ends here: its evidence joins the priors first
            self._priors[self._who], self._first_priors[self._who] = self.costs, self.first
            self._who = ""
        costs, first = copy.deepcopy(state)
        for store, value in ((self._priors, costs), (self._first_priors, first)):
            if value is None:
                store.pop(who, None)
            else:
                store[who] = value

    def learn_plain_speed(self, iteration_log: Sequence[dict]) -> None:
        """The plain passes' scale prior of the next calls, from a finished call's iteration log
        (``TorchRefEngine.last_iteration_log``; the engine reads it in its untimed ``warm_up``, so
        the baseline's passes, which no policy times, count too): the measured forward seconds of
        its one-token-a-row passes (not its first) over the table's, once it has
        ``PLAIN_PRIOR_PASSES`` of them."""
        if self.kind != "throughput_optimal" or self.lookup is None:
            return
        plain = [c for c in iteration_log if c["iteration"] > 0 and c["block_tokens"] == c["rows"]
                 and not c["draft_tokens"] and c["forward_s"] > 0]
        if len(plain) < PLAIN_PRIOR_PASSES:
            return
        measured = sum(c["forward_s"] for c in plain)
        predicted = sum(self.lookup(c["rows"], [1], c["context_sum"] / c["rows"])[0] for c in plain)
        if predicted > 0:
            self._plain_prior = measured / predicted

    def _seconds(self, rows: int, queries: Sequence[int], context: float) -> list[float]:
        """The table's seconds of passes of ``rows`` x each query width, scaled to now: a width
        of one by the plain passes' scale, wider ones (verifying drafts) by the drafted passes'."""
        plain, spec = self.costs.scale, self.costs.spec_scale
        return [s * (plain if q <= 1 else spec) for q, s in zip(queries, self.lookup(rows, queries, context))]

    def budget(self, live_rows: int, context_mean: float) -> int | None:
        """Before drafting: the cap for this iteration (0: do not ask the drafter)."""
        if self.kind == "fixed":
            return None
        if self.kind == "batch_threshold":
            return 0 if live_rows > self.max_rows else None
        self._idle += 1
        self.tracker.decay(DECAY)  # evidence ages by iterations: a verdict of long ago weighs little
        if self._idle > PROBE_AFTER and (self._last is None or self._last[1] == 0):
            probe = self._probe_budget(live_rows, context_mean)
            if probe:  # fresh evidence, bought where it is cheap (the tail of a step, on most hardware)
                self._probe, self._idle, self._last = probe, 0, None
                return probe
        if self._last is not None and self._last[0] == live_rows and self._last[2] < REDECIDE:
            self._last = (live_rows, self._last[1], self._last[2] + 1)  # the same batch: as decided
            return self._last[1]
        ks = list(CANDIDATE_BUDGETS)
        secs = self._seconds(live_rows, [1 + k for k in ks], context_mean)
        host, spec_host = self.costs.host(live_rows), self.costs.host_for(live_rows, True)
        drafter, verify = self.costs.drafter(live_rows), self.costs.verify
        nodes, tokens = [0.0], [1.0]  # a row's expected real nodes beyond its root and tokens, by budget
        for i, r in enumerate(self.tracker.chain_reach(ks[-1])):
            p = self.tracker.longer_than(i)
            nodes.append(nodes[-1] + p)
            tokens.append(tokens[-1] + p * r)
        rates = [live_rows * tokens[k] / (s + verify(live_rows * (1 + nodes[k])) + (spec_host + drafter if k else host))
                 for k, s in zip(ks, secs)]
        best = max(range(len(ks)), key=lambda i: (rates[i], -ks[i]))
        self._last = (live_rows, ks[best], 1)
        return ks[best]

    def _probe_budget(self, live_rows: int, context_mean: float) -> int:
        """The largest budget (at most 8) whose pass, proposals included, costs at most
        ``PROBE_SLACK`` more than a plain pass of the same rows (0 if none): at most one probe per
        ``PROBE_AFTER`` iterations, so probes that never pay lose at most 25% / 16 of the passes.

        Without probes a policy that once decided drafting does not pay never asks again, so
        it never sees that the drafts got better (as the step's cache fills) or that passes got
        cheap (few live rows): one bad first verdict (say, every row's draft at output length 1
        rejected) would hold for the whole rollout call."""
        ks = [k for k in CANDIDATE_BUDGETS if k <= 8]
        secs = self._seconds(live_rows, [1 + k for k in ks], context_mean)
        verify, drafter = self.costs.verify, self.costs.drafter(live_rows)
        plain = secs[0] + verify(live_rows) + self.costs.host(live_rows)
        spec_host = self.costs.host_for(live_rows, True)
        best = 0
        for k, s in zip(ks[1:], secs[1:]):
            if s + verify(live_rows * (1 + k)) + spec_host + drafter <= (1 + PROBE_SLACK) * plain:
                best = k
        return best

    def choose(self, drafts: Sequence, context_mean: float, cap: int | None) -> int | None:
        """Once the decoding rows' drafts are known (the untruncated proposals, one per row): the
        cap to verify (``cap``: ``budget``'s; throughput_optimal decides again over the real
        drafts). First drafts, at output length 0, go to ``choose_first``: counted here, such
        first drafts, often empty, made the policy believe no proposal would be long and never
        ask again."""
        if self.kind != "throughput_optimal":
            return cap
        lengths = [len(d) for d in drafts]
        longest = max(lengths, default=0)
        probe, self._probe = self._probe, 0
        best = 0
        if longest:
            best = min(probe, longest) if probe else self._choose(drafts, lengths, longest, context_mean)
        if best:
            self._idle = 0
        self.tracker.record_proposals(lengths)
        return best

    @property
    def first_drafts_decided(self) -> bool:
        """Whether this policy decides first drafts itself (``choose_first``), so that an iteration
        with new rows asks the drafter even when ``budget`` said 0 for the decoding rows."""
        return self.kind == "throughput_optimal"

    def choose_first(self, drafts: Sequence, rows: int, pending: int, context_mean: float,
                     cap: int | None) -> int | None:
        """The cap of the first drafts (rollouts at output length 0), verified inside their rows'
        prefill: a pass of ``rows`` rows ``pending`` tokens wide (the longest prompt), plus k.

        SPEC-RL's whole gain is one such draft (the previous rollout), so throughput_optimal
        weighs them on their own: the k that maximises the prefill's tokens per second, from the
        acceptance of this drafter's earlier first drafts (``first``: carried between its calls,
        aged by ``FIRST_DECAY`` each call; 1/2 a node before any), never the decoding drafts'.
        Other policies: ``cap`` (``budget``'s), as for any draft."""
        if self.kind != "throughput_optimal":
            return cap
        lengths = [len(d) for d in drafts]
        longest = max(lengths, default=0)
        if not longest:
            return 0
        top = CANDIDATE_BUDGETS[-1] * 64  # a first draft may be a whole rollout
        ks = sorted({k for k in (0, *CANDIDATE_BUDGETS, *(2 ** i for i in range(7, 13))) if k < longest}
                    | {min(longest, top)})
        reach = self.first.chain_reach(ks[-1])
        chain = [0.0]
        for r in reach:
            chain.append(chain[-1] + r)
        secs = self.lookup(rows, [pending + k for k in ks], context_mean)
        host = self.costs.host(rows)
        best, best_rate = 0, -1.0
        for k, s in zip(ks, secs):
            tokens = rows + sum(chain[min(k, n)] for n in lengths)
            nodes = rows + sum(min(k, n) for n in lengths)  # what the verifier reads: each row's root, the drafts
            rate = tokens / (s * self.costs.spec_scale + self.costs.verify(nodes) + host)
            if rate > best_rate:  # ties keep the smaller k
                best, best_rate = k, rate
        return best

    def _choose(self, drafts: Sequence, lengths: list[int], longest: int, context_mean: float) -> int:
        rows, top = len(lengths), CANDIDATE_BUDGETS[-1]
        ks = [k for k in CANDIDATE_BUDGETS if k < longest] + ([longest] if longest <= top else [])
        secs = self._seconds(rows, [1 + k for k in ks], context_mean)
        host, spec_host = self.costs.host(rows), self.costs.host_for(rows, True)
        rates = self.tracker.rates(min(longest, top))
        chain = [0.0]  # cumulative expected accepted of a chain, by its length
        r = 1.0
        for c in rates:
            r *= c
            chain.append(chain[-1] + r)
        prefixes = []  # per row: cumulative expected accepted of its first j nodes
        for d in drafts:
            n = min(len(d), top)
            if d.parents is None or n == 0:
                prefixes.append(None)
                continue
            reach, cum = [], [0.0]
            for i in range(n):
                p = d.parents[i]
                reach.append(rates[i] * (1.0 if p < 0 else reach[p]))
                cum.append(cum[-1] + reach[-1])
            prefixes.append(cum)
        best, best_rate = 0, -1.0
        for k, s in zip(ks, secs):
            tokens = float(rows)
            nodes = rows
            for n, cum in zip(lengths, prefixes):
                m = min(k, n)
                tokens += chain[m] if cum is None else cum[m]
                nodes += m
            rate = tokens / (s + self.costs.verify(nodes) + (spec_host if k else host))
            if rate > best_rate:  # ties keep the smaller k
                best, best_rate = k, rate
        return best

    def run_ahead_rows(self, live_rows: int, free: int, context_mean: float, trained_rows: int | None = None) -> int:
        """How many of ``free`` slots run-ahead rollouts (SRT's: generated only to feed the drafter
        caches) may take now. throughput_optimal admits them only into idle capacity: while an
        iteration of ``live_rows`` + n rows costs at most ``RUN_AHEAD_SLACK`` more than one of the
        ``trained_rows`` alone (default: all live rows; run-ahead rows already in flight count as
        cost, so the slack does not compound), as on a GPU decoding a short batch, not on this
        CPU, where every row costs its compute."""
        if self.kind != "throughput_optimal" or free <= 0:
            return free

        def cost(rows: int) -> float:
            return self._seconds(rows, [1], context_mean)[0] + self.costs.verify(rows) + self.costs.host(rows)

        limit = (1 + RUN_AHEAD_SLACK) * cost(live_rows if trained_rows is None else max(trained_rows, 1))
        if cost(live_rows) > limit:
            return 0
        lo, hi = 0, free  # the largest n with cost(live_rows + n) <= limit (cost grows with rows)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(live_rows + mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def record(self, draft_len: int, num_accepted: int, path: Sequence[int] | None = None,
               parents: Sequence[int] | None = None, first: bool = False) -> None:
        """One verified draft; ``first``: a rollout's first draft, verified in its prefill (counted
        apart: for most drafters nothing like the drafts that follow)."""
        if draft_len and self.kind == "throughput_optimal":  # the only policy that reads acceptance
            (self.first if first else self.tracker).record(draft_len, num_accepted, path, parents)

    def record_iteration(self, calls: Sequence[tuple[int, int, int, float, str]], context_mean: float,
                         verify_s: float, propose_s: float | None, host_s: float) -> None:
        """One iteration's measured seconds: its forward calls ``(rows, padded width, real nodes,
        forward seconds, kind)``, the verifier's seconds, the drafter's proposals (None: not asked)
        and the rest of the iteration (host). ``kind`` is ``plain`` (one token a row), ``drafted``
        (drafts verified) or ``prefill`` (prompt tokens in the block: its seconds say nothing of
        decoding (measured: a unit's first pass ran at 4-6x the table, results/LOG.md), so neither
        the scales nor the host fit read an iteration with one)."""
        if self.kind != "throughput_optimal" or not calls:
            return
        costs = self.costs
        if any(c[4] == "prefill" for c in calls):
            return
        for r, q, _, forward_s, kind in calls:
            table_s = self.lookup.one(r, q, context_mean)
            if kind == "drafted":
                costs.spec_measured += forward_s
                costs.spec_predicted += table_s
                costs.spec_passes += 1
            else:
                costs.measured += forward_s
                costs.predicted += table_s
                costs.passes += 1
        rows = sum(c[0] for c in calls)
        costs.verify.add(sum(c[2] for c in calls), verify_s)
        (costs.spec_host if any(c[4] == "drafted" for c in calls) else costs.host).add(rows, host_s)
        if propose_s is not None:
            costs.drafter.add(rows, propose_s)
