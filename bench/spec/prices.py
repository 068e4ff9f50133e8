"""Seconds that read no clock: every pass priced by a latency table, for any backend.

    python -m bench.harness.cli engine.seconds=table engine.latency_table=results/latency/here.csv ...
    python -m bench.harness.simulate TRACE --policy throughput_optimal --table results/latency/here.csv

Why: ``throughput_optimal`` decides from seconds, and seconds measured on a machine differ from
run to run, so two runs of it (the engine and the simulator, or a run and its resume) may draft
differently. Under :class:`TablePrices` the scheduler replaces each pass's measured seconds by the
table's price of its shape (rows, padded query width, the pass's mean context), counts the
verifier, the drafter and the host as costing nothing, and keeps time on a :class:`VirtualClock`
that advances only by those prices. The policy's machine-speed terms are then fixed (its host,
verifier and drafter fits 0; its scales exactly 1 on a latency table, the padding ratio on a
roofline, which prices real query tokens), so its decisions, the counters and the iteration log
depend on the tokens and the table alone: equal on every backend, by construction.
"""
from __future__ import annotations


class VirtualClock:
    """A clock that moves only when told (``advance``); the scheduler's ``clock`` under prices."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TablePrices:
    """A pass of ``rows`` rows, each padded to ``width`` query tokens (``query_tokens`` in all), at
    mean context ``context`` costs the table's seconds: a ``LatencyTable`` read through a memo of
    its own (``TableLookup``, as the policy reads it), or a table with a ``price`` of its own (the
    roofline prices the real query tokens, as ``bench.spec.latency.pass_seconds`` does)."""

    def __init__(self, table):
        from bench.spec.policy_table import TableLookup
        if not hasattr(table, "query_seconds"):
            raise ValueError("priced seconds need a latency table (python -m bench.benchmarks latency profile writes one)")
        self.table = table
        self.lookup = TableLookup(table)

    def __call__(self, rows: int, width: int, context: float, query_tokens: int) -> float:
        price = getattr(self.table, "price", None)
        if price is not None:
            return price(rows, width, context, query_tokens)
        return self.lookup.one(rows, width, context)


__all__ = ["TablePrices", "VirtualClock"]
