"""The acceptance a speculation policy expects: per draft node, counted as the exact rule walks a draft.

``throughput_optimal`` (``bench/spec/policy.py``) reads the tokens a row is expected to emit under
each cap from an ``AcceptanceTracker``: one for the decoding drafts of a rollout call, one for
first drafts (carried between a drafter's calls, aged by ``aged``). Design: docs/policies.md.

    python -m pytest -q tests/test_spec_policy.py
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


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


def aged(tracker: AcceptanceTracker | None, factor: float) -> AcceptanceTracker:
    """A copy of ``tracker`` with its evidence weighed by ``factor`` (a new one for None)."""
    if tracker is None:
        return AcceptanceTracker()
    out = AcceptanceTracker(list(tracker.reached), list(tracker.hit), list(tracker.longer), tracker.asked,
                            tracker.weight)
    out.decay(factor)
    return out
