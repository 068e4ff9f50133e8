"""The latency table as the speculation policy and the engine read it: many times an iteration, so memoized.

``SpecPolicy`` (``bench/spec/policy.py``) prices every candidate budget from it; the scheduler's
forward split (``bench/spec/scheduler.py``) and ``TablePrices`` (``bench/spec/prices.py``) read it too.

    python -m pytest -q tests/test_spec_policy.py -k table_lookup
"""
from __future__ import annotations

import math
from typing import Sequence

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
