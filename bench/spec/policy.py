"""Speculation policies: how many draft tokens each row may verify this iteration, for every method.

    python -m bench.harness.cli engine.spec_policy=throughput_optimal     # see conf/engine/torch_ref.yaml

A policy is an engine knob, not a method's: it caps the draft budget of an iteration from the live
batch and the acceptance seen so far, and never touches what is emitted, so exact methods stay
token-identical to the baseline under every policy (tests/test_latency.py; the pieces in
tests/test_spec_policy.py).

- ``fixed``: the method's own budget (the default; what every paper runs).
- ``batch_threshold``: no drafts while more than ``max_rows`` rows are live (vLLM's
  ``disable_by_batch_size``; TLT speculates only below 32 running requests).
- ``throughput_optimal``: the k that maximises expected tokens per second (vLLM's dynamic
  speculation chooses k the same way), where an iteration's seconds are what it costs whole:

      seconds(0) = s * table(rows, 1, context) + verify(rows) + host(rows)
      seconds(k) = s' * table(rows, 1 + k, context) + verify(nodes) + host'(rows) + drafter(rows)

  ``table`` is the latency table of this engine and model (its forward pass: the block and its
  mask, the model, the output layer on the verified nodes; ``bench.engines.torch.timing``); ``s``
  scales it to the machine's speed now (the measured forward seconds of plain passes over the
  table's, this rollout call) and ``s'`` the same for passes that verify drafts (these run further
  above the table on a core the drafter shares); ``verify`` is the verifier's seconds, linear in
  the nodes it reads; ``host`` the rest of an iteration (bookkeeping, the drafter's ``observe``,
  dropping finished rows) and ``host'`` the same in iterations that verify drafts, and
  ``drafter`` the seconds of asking (the drafter's proposals and this policy's choice over them,
  paid only when it is asked), each linear in the live rows (``CostModel``).
  They are fitted to this rollout call's iteration log (each drafter's fits of its previous
  call are the prior; the replay keeps one drafter per method). Prefills are no evidence of
  decoding's speed, and the plain passes' scale starts from the plain passes of the engine's
  last call (``learn_plain_speed``, read in the engine's untimed warm-up). First drafts
  (``choose_first``) are decided apart, on their own acceptance. A row's expected
  tokens are the bonus plus the running acceptance of each draft node given its parent was
  accepted, multiplied along the draft (``AcceptanceTracker``; every iteration weighs the evidence
  before it by ``DECAY``, so the estimate follows the rollout), times the chance that its
  proposal is that long (the first draft of a rollout, verified in its prefill, is not counted,
  neither in the acceptance nor in the lengths). Decided
  twice: before the drafter is asked (``budget``: 0 = not even asked, nor told the live batch,
  when no k pays for the proposal; decided again when the live rows change, else every
  ``REDECIDE`` iterations) and, each drafted iteration, once the drafts are known (``choose``:
  the cap over the real drafts, the proposal's seconds sunk, the block padded to its longest row).
  After ``PROBE_AFTER`` iterations without a verified draft it probes: asks the drafter and
  verifies the largest budget whose pass costs at most ``PROBE_SLACK`` more than a plain one
  (``_probe_budget``), so a verdict of "drafting does not pay" is checked again where checking is
  cheap (measured: without probes, every suffix_global and seer draft at output length 1 being
  rejected kept both from drafting for the rest of the step, results/LOG.md).
  Run-ahead rollouts (``tree_cache_runahead``) are admitted only into idle capacity
  (``run_ahead_rows``). The acceptance is counted per rollout call (one step of one method); the
  measured seconds make the drafts (never the tokens) depend on the machine's speed, and the
  fits carried between calls live in the engine, not in a unit's snapshot: a resumed run emits
  the same tokens but may draft, count and admit run-ahead rows differently (the resume tests
  run the ``fixed`` policy, whose decisions read no clock). The replay's timing repeats put the
  carried evidence back before each repeat (``carried``, ``restore_carried``).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Sequence

POLICIES = ("fixed", "batch_threshold", "throughput_optimal")
CANDIDATE_BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
REDECIDE = 8  # throughput_optimal: budget() decides again when the live rows change or after this many iterations
RUN_AHEAD_SLACK = 0.05  # throughput_optimal: run-ahead rows only while they add at most 5% to an iteration
DECAY = 0.8  # throughput_optimal: acceptance evidence weighs this much less with every iteration (about 5 iterations' memory)
PROBE_AFTER = 16  # throughput_optimal: after this many iterations without a verified draft, probe ...
PROBE_SLACK = 0.25  # ... if its pass costs at most 25% more than a plain one: at most 25% / 16 = 1.6% lost if probes never pay
PLAIN_PRIOR_PASSES = 8  # throughput_optimal: the last call's plain-pass scale weighs as much as this many passes
FIRST_DECAY = 0.5  # throughput_optimal: first drafts' acceptance of earlier calls weighs half as much each call
SPEC_PRIOR_PASSES = 4  # throughput_optimal: the carried drafted-pass scale weighs as much as this many passes
CONTEXT_STEP = 0.01  # TableLookup: the context is rounded to steps of 1% (in log space) before the table is read


class TableLookup:
    """The latency table as the policy and the engine read it: many times an iteration, so memoized
    by (rows, query width, context rounded to ``CONTEXT_STEP`` in log space).

    Why: ``LatencyTable.query_seconds`` costs about 7 us a call in Python (measured on this CPU),
    and an iteration asked it up to eight times (the budget, the forward split, the iteration's
    record), which was most of the host time a drafting method paid over the baseline in the tail
    of a step, at 1.6 ms an iteration (results/LOG.md). A pass's seconds move by far less than 1%
    across a 1% step of context, and every read of one rounded context gives the same seconds, so
    a decision does not depend on which context filled the memo first."""

    LIMIT = 1 << 16  # entries before the memo starts again (a call of 256 rows x 4k tokens fills a few thousand)

    def __init__(self, table):
        self.table = table
        self._memo: dict[tuple, float] = {}

    @staticmethod
    def _step(context: float) -> int:
        return round(math.log(max(float(context), 1.0)) / CONTEXT_STEP)

    def __call__(self, rows: int, queries: Sequence[int], context: float) -> list[float]:
        step = self._step(context)
        memo = self._memo
        out = [memo.get((rows, q, step)) for q in queries]
        if None in out:
            missing = [q for q, s in zip(queries, out) if s is None]
            if len(memo) > self.LIMIT:
                memo.clear()  # the hits read above are already in ``out``
            found = dict(zip(missing, self.table.query_seconds(rows, missing, math.exp(step * CONTEXT_STEP))))
            for q, s in found.items():
                memo[(rows, q, step)] = s
            out = [found[q] if s is None else s for q, s in zip(queries, out)]
        return out

    def one(self, rows: int, query: int, context: float) -> float:
        """The seconds of one pass (the engine's forward split asks for these one at a time)."""
        s = self._memo.get((rows, query, self._step(context)))
        return self(rows, [query], context)[0] if s is None else s


@dataclass
class AcceptanceTracker:
    """Acceptance by draft node index i, counted as the exact rule walks a draft: node i is
    *reached* when its parent is the root or lies on the accepted path, and *hit* when it lies on
    the path itself; rate(i) = P(hit | reached), smoothed towards the pooled rate of every node.
    For a chain, node i is reached when the i nodes before it were accepted, so P(node i accepted)
    is the product of the rates up to i; for a tree, the product along the node's ancestors. A cap
    of k keeps a draft's first k nodes (parents precede children) and the rule then descends the
    same path as far as it stays inside them, so a draft's expected accepted tokens under cap k are
    the sum of those products over its first k nodes. Also counted: how long the proposals were
    before any cap (longer[i]: proposals longer than i, of ``asked``).
    """

    reached: list[float] = field(default_factory=list)  # counts, weighed down by ``decay``
    hit: list[float] = field(default_factory=list)
    longer: list[float] = field(default_factory=list)
    asked: float = 0
    weight: float = 2.0  # the pooled prior's weight, in reached nodes

    def record(self, draft_len: int, num_accepted: int, path: Sequence[int] | None = None,
               parents: Sequence[int] | None = None) -> None:
        """One verified draft of ``draft_len`` nodes: ``path`` the draft indices of its accepted
        nodes (None: nodes 0 .. num_accepted - 1), ``parents`` its parents (None: a chain)."""
        if len(self.reached) < draft_len:
            self.reached.extend([0] * (draft_len - len(self.reached)))
            self.hit.extend([0] * (draft_len - len(self.hit)))
        if parents is None and path is None:  # a chain: nodes 0 .. a reached, 0 .. a - 1 hit
            a = min(num_accepted, draft_len)
            for i in range(min(a + 1, draft_len)):
                self.reached[i] += 1
            for i in range(a):
                self.hit[i] += 1
            return
        on = set(range(num_accepted)) if path is None else set(path)
        par = range(-1, draft_len - 1) if parents is None else parents
        for i in range(draft_len):
            p = par[i]
            if p < 0 or p in on:
                self.reached[i] += 1
                if i in on:
                    self.hit[i] += 1

    def decay(self, factor: float) -> None:
        """Weigh the evidence so far by ``factor`` (once per iteration): acceptance changes
        along a rollout (a drafter's first drafts, at a handful of output tokens, are often all
        wrong for every row alike), and an estimate should follow it, not carry its first verdict."""
        self.reached = [x * factor for x in self.reached]
        self.hit = [x * factor for x in self.hit]
        self.longer = [x * factor for x in self.longer]
        self.asked *= factor

    def record_proposals(self, lengths: Sequence[int]) -> None:
        """The untruncated lengths of one iteration's proposals (one per live row)."""
        self.asked += len(lengths)
        for n in lengths:
            _count_below(self.longer, n)

    def rates(self, k: int) -> list[float]:
        """rate(i) = P(node i accepted | reached) for i < k, each smoothed towards the pooled rate
        (1/2 before any evidence)."""
        pooled = (sum(self.hit) + 1) / (sum(self.reached) + 2)
        w = self.weight
        n = len(self.reached)
        return [((self.hit[i] if i < n else 0) + w * pooled) / ((self.reached[i] if i < n else 0) + w)
                for i in range(k)]

    def rate(self, i: int) -> float:
        return self.rates(i + 1)[i]

    def chain_reach(self, k: int) -> list[float]:
        """P(node i of a chain accepted), i < k: the rates multiplied along the chain."""
        out, r = [], 1.0
        for c in self.rates(k):
            r *= c
            out.append(r)
        return out

    def expected_tokens(self, k: int, parents: Sequence[int] | None = None) -> float:
        """Tokens one row emits per pass with a draft of k nodes (a chain, or a tree of these
        parents): the bonus plus the expected accepted."""
        if parents is None:
            return 1.0 + sum(self.chain_reach(k))
        rates, reach = self.rates(k), []
        for i in range(k):
            reach.append(rates[i] * (1.0 if parents[i] < 0 else reach[parents[i]]))
        return 1.0 + sum(reach)

    def longer_than(self, i: int) -> float:
        """P(a proposal is longer than i), with a prior of one proposal as long as asked."""
        return ((self.longer[i] if i < len(self.longer) else 0) + 1) / (self.asked + 1)

    def expected_row_tokens(self, k: int) -> float:
        """Tokens a row emits with budget k when its proposal may be shorter than k (as a chain)."""
        return 1.0 + sum(r * self.longer_than(i) for i, r in enumerate(self.chain_reach(k)))


def _count_below(counts: list[int], n: int) -> None:
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1


@dataclass
class LinearFit:
    """seconds = a + b * rows by least squares over what was seen (the mean per row with one
    distinct row count; 0 before any evidence)."""

    n: float = 0.0
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0

    def add(self, rows: float, seconds: float) -> None:
        self.n += 1
        self.sx += rows
        self.sxx += rows * rows
        self.sy += seconds
        self.sxy += rows * seconds

    def __call__(self, rows: float) -> float:
        if self.n == 0:
            return 0.0
        det = self.n * self.sxx - self.sx * self.sx
        if self.n < 3 or det <= 1e-9 * max(1.0, self.sxx * self.n):
            return max(0.0, self.sy / max(self.sx, 1e-12) * rows)
        b = (self.n * self.sxy - self.sx * self.sy) / det
        a = (self.sy - b * self.sx) / self.n
        if a < 0 or b < 0:  # keep it a cost: the better of the two one-parameter fits
            return max(0.0, self.sy / max(self.sx, 1e-12) * rows) if b >= 0 else max(0.0, self.sy / self.n)
        return a + b * rows


@dataclass
class CostModel:
    """What an iteration costs beyond the table: the table's scale now (one for plain passes, one
    for passes that verify drafts), the verifier's seconds by nodes, the host seconds of an
    iteration (plain, and with drafts verified) and the drafter's proposal seconds by rows.

    Why two of each: on a machine where the policy shares a core with the drafter, a pass that
    verifies drafts runs further above the table than a plain one (measured on this CPU: 0.87-1.19
    of the table against 0.70-0.81 for plain passes of the same run, results/LOG.md), and an
    iteration that verified drafts spends more host time (longer emitted lists, KV slot moves, the
    drafter's ``observe`` of them); one scale and one host fit for both, dominated by the many
    plain iterations, made drafting look cheaper than it is."""

    measured: float = 0.0  # forward seconds of plain passes measured, and the table's seconds for them
    predicted: float = 0.0
    passes: int = 0
    prior: float = 1.0  # plain passes' scale before this call's evidence (the engine's last call's)
    spec_measured: float = 0.0  # the same for passes that verified drafts
    spec_predicted: float = 0.0
    spec_passes: int = 0
    spec_prior: float = 1.0  # drafted passes' scale over the plain one, before this call's evidence
    verify: LinearFit = field(default_factory=LinearFit)
    host: LinearFit = field(default_factory=LinearFit)
    spec_host: LinearFit = field(default_factory=LinearFit)
    drafter: LinearFit = field(default_factory=LinearFit)

    @property
    def scale(self) -> float:
        """Plain passes: the measured forward seconds over the table's, this call, shrunk towards
        ``prior`` by ``PLAIN_PRIOR_PASSES`` pseudo-passes. A policy that drafts in most iterations
        sees few plain passes, and the first of a call run cold (1.6-1.7x the later ones, measured):
        on those alone a plain pass looked as dear as a drafted one."""
        if self.predicted <= 0 or self.measured <= 0:
            return self.prior
        n = self.passes
        return (n * self.measured / self.predicted + PLAIN_PRIOR_PASSES * self.prior) / (n + PLAIN_PRIOR_PASSES)

    @property
    def spec_scale(self) -> float:
        """Passes that verify drafts: their own ratio, shrunk towards ``spec_prior`` x the plain
        scale by ``SPEC_PRIOR_PASSES`` pseudo-passes (the carried ratio of the drafter's last call)."""
        prior = self.spec_prior * self.scale
        if self.spec_predicted <= 0 or self.spec_measured <= 0:
            return prior
        n = self.spec_passes
        return (n * self.spec_measured / self.spec_predicted + SPEC_PRIOR_PASSES * prior) / (n + SPEC_PRIOR_PASSES)

    def host_for(self, rows: float, drafting: bool) -> float:
        """Host seconds of an iteration of ``rows``; one that verifies drafts uses its own fit once
        it has evidence (the plain one before)."""
        return self.spec_host(rows) if drafting and self.spec_host.n else self.host(rows)

    def carried(self, prior: float = 1.0) -> "CostModel":
        """The prior of the next call of the same method: the fits and the drafted passes' ratio
        to plain ones; the plain scale's prior ``prior`` is the engine's (any method's last call)."""
        ratio = self.spec_scale / self.scale if self.spec_passes else self.spec_prior
        return CostModel(prior=prior, spec_prior=ratio, verify=_copy(self.verify), host=_copy(self.host),
                         spec_host=_copy(self.spec_host), drafter=_copy(self.drafter))


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
        self.first = _aged(self._first_priors.get(who), FIRST_DECAY)
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


def _aged(tracker: AcceptanceTracker | None, factor: float) -> AcceptanceTracker:
    """A copy of ``tracker`` with its evidence weighed by ``factor`` (a new one for None)."""
    if tracker is None:
        return AcceptanceTracker()
    out = AcceptanceTracker(list(tracker.reached), list(tracker.hit), list(tracker.longer), tracker.asked,
                            tracker.weight)
    out.decay(factor)
    return out


def _copy(fit: LinearFit) -> LinearFit:
    return LinearFit(fit.n, fit.sx, fit.sxx, fit.sy, fit.sxy)
