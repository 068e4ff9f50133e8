"""What an iteration costs beyond the latency table, as the speculation policy fits it from the iteration log.

``throughput_optimal`` (``bench/spec/policy.py``) prices a budget as the table's seconds scaled to the
machine now, plus the verifier's, the host's and the drafter's seconds, each a ``LinearFit`` in
rows or nodes; ``CostModel`` holds them and what carries to a drafter's next call. Design:
docs/policies.md.

    python -m pytest -q tests/test_spec_policy.py
"""
from __future__ import annotations

from dataclasses import dataclass, field

PLAIN_PRIOR_PASSES = 8  # throughput_optimal: the last call's plain-pass scale weighs as much as this many passes
SPEC_PRIOR_PASSES = 4  # throughput_optimal: the carried drafted-pass scale weighs as much as this many passes


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


def _copy(fit: LinearFit) -> LinearFit:
    return LinearFit(fit.n, fit.sx, fit.sxx, fit.sy, fit.sxy)
