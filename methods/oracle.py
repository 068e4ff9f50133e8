"""The oracle drafter: drafts a rollout's own future from an earlier run with the same seed.

Under coupled sampling a baseline run with the same seed produces exactly the tokens the current
run will produce, so drafting them bounds what any drafter can gain on an engine. Used by tests
and by ``python -m bench.benchmarks oracle``.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .base import Draft, NullDrafter, RolloutKey


class OracleDrafter(NullDrafter):
    """Drafts ``futures[key][len(output):]`` while the output still agrees with it.

    Example: futures {k: [4, 9, 2, 0]}, output [4], budget 2 -> Draft([9, 2]).
    After the output diverges (say [4, 7]) it drafts nothing for that rollout.
    """

    name = "oracle"

    def __init__(self, futures: Mapping[RolloutKey, Sequence[int]], max_spec_tokens: int | None = None):
        self.futures = {k: list(v) for k, v in futures.items()}
        self.max_spec_tokens = max_spec_tokens
        self._agrees: dict[RolloutKey, int] = {}  # key -> output length known to agree, -1 diverged

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        self._agrees[key] = 0

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None:
        n = self._agrees.get(key, -1)
        if n < 0:
            return
        future = self.futures.get(key, [])
        self._agrees[key] = n + len(new_tokens) if list(new_tokens) == future[n:n + len(new_tokens)] else -1

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        if self._agrees.get(key, -1) != len(output):
            return Draft()
        if self.max_spec_tokens is not None:
            budget = min(budget, self.max_spec_tokens)
        return Draft(self.futures.get(key, [])[len(output):len(output) + budget])
