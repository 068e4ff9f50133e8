"""SPEC-RL: draft the previous visit's rollout of the same (prompt, sample) slot as one long chain.

    python -m pytest tests/test_drafters.py -q -k prefix_reuse

The verification rule is the harness's choice (``verify.rule: ratio`` with lenience as released,
or ``exact``); this drafter only supplies the old tokens with their old logprobs and counts how
much of them survived (SPEC-RL's skip ratio and mean accepted prefix length).
"""
from __future__ import annotations

import sys
from typing import Sequence

from methods.base import Draft, NO_DRAFT, NullDrafter, Rollout, RolloutKey


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixReuseDrafter(NullDrafter):
    """Keeps the last finished rollout per RolloutKey and proposes it once, at output length 0.

    ``max_spec_tokens=None`` drafts the whole previous response (the engine's budget still caps it).
    """

    drafts = "first"  # one draft, at output length 0: engines verify it by a scoring pass

    name = "prefix_reuse"

    def __init__(self, max_spec_tokens: int | None = None):
        self.max_spec_tokens = max_spec_tokens
        self._previous: dict[RolloutKey, tuple[list[int], list[float]]] = {}
        self._drafted: dict[RolloutKey, tuple[list[int], int]] = {}  # key -> (draft, previous length)
        self.reset_stats()

    def reset_stats(self) -> None:
        self._rollouts = 0
        self._drafted_rollouts = 0
        self._full_reuse = 0
        self._draft_tokens = 0
        self._accepted_prefix_tokens = 0

    def has_previous(self, key: RolloutKey) -> bool:
        return key in self._previous

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        self._drafted.pop(key, None)

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        """The previous response of this slot, once, before the first new token.

        Example: the last visit of slot (p7, 0) finished with tokens [4, 9, 2] and logprobs
        [-0.1, -0.5, -0.2]; now ``propose(key, [], budget=2) -> Draft([4, 9], None, [-0.1, -0.5])``,
        and any later call (output [4, 9, 5]) gives ``Draft([])``.
        """
        if output or key in self._drafted:
            return NO_DRAFT
        previous = self._previous.get(key)
        if previous is None:
            return NO_DRAFT
        tokens, logprobs = previous
        n = min(len(tokens), budget)
        if self.max_spec_tokens is not None:
            n = min(n, self.max_spec_tokens)
        if n <= 0:
            return NO_DRAFT
        self._drafted[key] = (tokens[:n], len(tokens))
        self._draft_tokens += n
        return Draft(tokens[:n], None, logprobs[:n])

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        self._rollouts += 1
        drafted = self._drafted.pop(key, None)
        if drafted is not None:
            draft, previous_len = drafted
            accepted = common_prefix_len(rollout.token_ids, draft)
            self._drafted_rollouts += 1
            self._accepted_prefix_tokens += accepted
            self._full_reuse += accepted == previous_len
        self._previous[key] = (list(rollout.token_ids), list(rollout.logprobs))

    def stats(self) -> dict:
        drafted = self._drafted_rollouts
        tokens = sum(len(t) for t, _ in self._previous.values())
        return {
            "cache_entries": len(self._previous),
            "cache_tokens": tokens,
            "cache_bytes": tokens * 16 + len(self._previous) * (sys.getsizeof([]) * 2 + 64),
            "rollouts": self._rollouts,
            "drafted_rollouts": drafted,
            "draft_tokens": self._draft_tokens,
            "full_reuse_rollouts": self._full_reuse,
            "skip_ratio": self._full_reuse / drafted if drafted else 0.0,
            "accepted_prefix_tokens": self._accepted_prefix_tokens,
            "mean_accepted_prefix": self._accepted_prefix_tokens / drafted if drafted else 0.0,
        }
