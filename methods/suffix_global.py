"""SuffixDecoding as a control: one global trie of earlier responses plus each request's own prompt trie.

    python -m pytest tests/test_drafters.py -q -k suffix_global

The global trie holds the last ``max_cached_responses`` finished responses of every prompt (FIFO:
the oldest is removed when a new one would exceed the cap); each running request has a trie of
its own prompt + output. Both are asked with SuffixDecoding's rule and the higher score wins
(the request's own trie on ties, as in ArcticInference's cache). SRT reports that this global
cache slowed DAPO rollouts down: it is the negative control for per-prompt trees.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from .base import Draft, NullDrafter, Rollout, RolloutKey
from .suffix_tree import ContextMatcher, SuffixTrie

OWN = 0  # sequence id of the request inside its own trie


class SuffixGlobalDrafter(NullDrafter):
    """Global response trie + per-request prompt trie, depth 24, factor 1.0, min_prob 0.1."""

    name = "suffix_global"

    def __init__(self, max_depth: int = 24, max_cached_responses: int = 10000,
                 max_spec_tokens: int = 24, factor: float = 1.0, offset: float = 0.0,
                 min_prob: float = 0.1, tree: bool = False):
        self.max_depth = max_depth
        self.max_cached_responses = max_cached_responses
        self.max_spec_tokens = max_spec_tokens
        self.factor = factor
        self.offset = offset
        self.min_prob = min_prob
        self.tree = tree
        self.global_trie = SuffixTrie(max_depth)
        self._cached: deque[int] = deque()  # global sequence ids, oldest first
        self._next_seq = 0
        self._own: dict[RolloutKey, SuffixTrie] = {}
        self._matchers: dict[RolloutKey, ContextMatcher] = {}
        self._prompt_len: dict[RolloutKey, int] = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        self._proposals = 0
        self._drafts = 0
        self._draft_tokens = 0
        self._own_wins = 0
        self._global_wins = 0
        self._evictions = 0

    def begin_step(self, step: int) -> None:
        self._own.clear()  # requests of the last step that never finished
        self._matchers.clear()
        self._prompt_len.clear()

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        own = SuffixTrie(self.max_depth)
        own.extend(OWN, prompt)
        self._own[key] = own
        self._matchers[key] = ContextMatcher(self.global_trie, prompt)
        self._prompt_len[key] = len(prompt)

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None:
        own = self._own.get(key)
        if own is not None:
            own.extend(OWN, new_tokens)
            self._matchers[key].feed(new_tokens)

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        """The better of the own-trie draft and the global-trie draft.

        Example: the global trie holds the earlier response [3, 4, 5]; a request with prompt
        [1, 2] is at output [3]. Its own trie has [1, 2, 3] (3 has no continuation there); the
        global match of [3] (share 1) drafts ``Draft([4])`` (budget 1 for match length 1;
        [2, 3] does not occur globally).
        """
        self._proposals += 1
        own = self._own.get(key)
        limit = min(self.max_spec_tokens, budget)
        if own is None or limit <= 0:
            return Draft()
        have = len(own.sequence(OWN)) - self._prompt_len[key] if OWN in own else 0
        if have < len(output):  # tokens the engine did not observe(): take them
            self.observe(key, output[have:])
        args = (limit, self.factor, self.offset, self.min_prob, self.tree)
        own_spec = own.speculate(own.own_matches(OWN), *args)
        global_spec = self.global_trie.speculate(self._matchers[key].matches(), *args)
        if own_spec.score >= global_spec.score:
            spec = own_spec
            self._own_wins += bool(spec.token_ids)
        else:
            spec = global_spec
            self._global_wins += 1
        if spec.token_ids:
            self._drafts += 1
            self._draft_tokens += len(spec.token_ids)
        return spec.draft()

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        self._own.pop(key, None)
        self._matchers.pop(key, None)
        self._prompt_len.pop(key, None)
        if self.max_cached_responses <= 0 or not rollout.token_ids:
            return
        self.global_trie.extend(self._next_seq, rollout.token_ids)
        self._cached.append(self._next_seq)
        self._next_seq += 1
        while len(self._cached) > self.max_cached_responses:
            self.global_trie.remove(self._cached.popleft())
            self._evictions += 1

    def cached_sequence_ids(self) -> list[int]:
        return list(self._cached)

    def stats(self) -> dict:
        return {
            "cached_responses": len(self._cached),
            "global_nodes": self.global_trie.num_nodes,
            "own_tries": len(self._own),
            "cache_bytes": self.global_trie.approx_bytes() + sum(t.approx_bytes() for t in self._own.values()),
            "proposals": self._proposals,
            "drafts": self._drafts,
            "draft_tokens": self._draft_tokens,
            "own_wins": self._own_wins,
            "global_wins": self._global_wins,
            "evictions": self._evictions,
        }
