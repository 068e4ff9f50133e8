"""Speculation policies: how many draft tokens each row may verify this iteration, for every method.

    python -m bench.cli engine.spec_policy=throughput_optimal     # see conf/engine/torch_ref.yaml

A policy is an engine knob, not a method's: it caps the draft budget of an iteration from the live
batch and the acceptance seen so far, and never touches what is emitted, so exact methods stay
token-identical to the baseline under every policy (tests/test_spec_policy.py).

- ``fixed``: the method's own budget (the default; what every paper runs).
- ``batch_threshold``: no drafts while more than ``max_rows`` rows are live (vLLM's
  ``disable_by_batch_size``; TLT speculates only below 32 running requests).
- ``throughput_optimal``: the k that maximises expected tokens per second, rows x (1 + sum of
  the running per-position acceptance up to k) / latency(rows, 1 + k, context), from a latency
  table of this engine and model (vLLM's dynamic speculation chooses k the same way). The
  acceptance is counted per rollout call (one step of one method), so the choice is a pure
  function of the step's own history and a resumed run chooses as the uninterrupted one did.
"""
from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("fixed", "batch_threshold", "throughput_optimal")
CANDIDATE_BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class AcceptanceTracker:
    """Per draft position: how often it was offered and accepted (offered[i]: drafts longer than i)."""

    offered: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def record(self, draft_len: int, num_accepted: int) -> None:
        for counts, n in ((self.offered, draft_len), (self.accepted, num_accepted)):
            if len(counts) < n:
                counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    def rate(self, i: int) -> float:
        """P(position i accepted | offered), with a uniform prior (1/2 before any evidence)."""
        offered = self.offered[i] if i < len(self.offered) else 0
        accepted = self.accepted[i] if i < len(self.accepted) else 0
        return (accepted + 1) / (offered + 2)

    def expected_tokens(self, k: int) -> float:
        """Tokens one row emits per pass with budget k: the bonus plus the expected accepted.
        Position i counts only if all before it were accepted, so rates multiply along the chain."""
        total, reach = 1.0, 1.0
        for i in range(k):
            reach *= self.rate(i)
            total += reach
        return total


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
                             "path written by python -m bench.latency profile")
        self.kind, self.max_rows, self.table = kind, max_rows, table
        self.tracker = AcceptanceTracker()

    def start_call(self) -> None:
        self.tracker = AcceptanceTracker()

    def budget(self, live_rows: int, context_mean: float) -> int | None:
        if self.kind == "fixed":
            return None
        if self.kind == "batch_threshold":
            return 0 if live_rows > self.max_rows else None
        ks = list(CANDIDATE_BUDGETS)
        secs = self.table.seconds([live_rows] * len(ks), [1 + k for k in ks], [context_mean] * len(ks))
        rates = [live_rows * self.tracker.expected_tokens(k) / s for k, s in zip(ks, secs)]
        best = max(range(len(ks)), key=lambda i: (rates[i], -ks[i]))
        return ks[best]

    def record(self, draft_len: int, num_accepted: int) -> None:
        if draft_len and self.kind == "throughput_optimal":  # the only policy that reads acceptance
            self.tracker.record(draft_len, num_accepted)
