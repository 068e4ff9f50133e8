"""Ours: SPEC-RL's whole previous response as the first draft, then SRT tree-cache drafting.

    python -m pytest tests/test_drafters.py -q -k hybrid

Prefix reuse is strong while the new rollout still agrees with the old one and useless after
the first rejection; the per-prompt tree (with in-flight sibling tokens) keeps drafting after
that. Both parts see every call, so the tree learns the rollout's tokens from its first one.
Run it with ``verify.rule: exact`` (lossless).
"""
from __future__ import annotations

from typing import Sequence

from methods.base import Draft, NullDrafter, Rollout, RolloutKey
from methods.prefix_reuse import PrefixReuseDrafter
from methods.tree_cache import TreeCacheDrafter


class HybridDrafter(NullDrafter):
    """Composes PrefixReuseDrafter (first draft) and TreeCacheDrafter (every later draft)."""

    name = "hybrid"

    def __init__(self, prefix_max_spec_tokens: int | None = None, max_depth: int = 64,
                 max_spec_tokens: int = 24, factor: float = 1.0, offset: float = 0.0,
                 min_prob: float = 0.1, tree: bool = False, run_ahead: bool = False,
                 match: str = "longest", backend: str = "auto"):
        self.prefix = PrefixReuseDrafter(max_spec_tokens=prefix_max_spec_tokens)
        self.tree_cache = TreeCacheDrafter(max_depth=max_depth, max_spec_tokens=max_spec_tokens,
                                           factor=factor, offset=offset, min_prob=min_prob,
                                           tree=tree, run_ahead=run_ahead, match=match, backend=backend)
        self.backend = self.tree_cache.backend
        self._parts = (self.prefix, self.tree_cache)

    def begin_step(self, step: int) -> None:
        for part in self._parts:
            part.begin_step(step)

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        for part in self._parts:
            part.start(key, prompt)

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        """Previous response of the slot first; the prompt's tree afterwards.

        Example: slot (p, 0) answered [1, 2, 3, 1, 2, 3] at the last visit. At output [] the
        draft is that whole response with its old logprobs. Say 1 and 2 are accepted and 7 is
        sampled, then 1: at output [1, 2, 7, 1] prefix reuse is spent, and the tree (the old
        response plus this rollout's own tokens) matches only [1], followed by 2 in 3 of its 4
        occurrences, so it drafts ``Draft([2])`` (budget 1 for match length 1).
        """
        draft = self.prefix.propose(key, output, budget)
        if draft.token_ids:
            return draft
        return self.tree_cache.propose(key, output, budget)

    def propose_batch(self, keys: Sequence[RolloutKey], outputs: Sequence[Sequence[int]],
                      budgets: Sequence[int]) -> list[Draft]:
        """``propose`` for each row: prefix reuse's drafts, then the tree's batch for the rest (the
        parts keep separate state, so asking part by part equals asking row by row)."""
        drafts = self.prefix.propose_batch(keys, outputs, budgets)
        rest = [i for i, d in enumerate(drafts) if not d.token_ids]
        if rest:
            whole = len(rest) == len(keys)
            tree = self.tree_cache.propose_batch(keys if whole else [keys[i] for i in rest],
                                                 outputs if whole else [outputs[i] for i in rest],
                                                 budgets if whole else [budgets[i] for i in rest])
            for i, d in zip(rest, tree):
                drafts[i] = d
        return drafts

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None:
        for part in self._parts:
            part.observe(key, new_tokens)

    def observe_batch(self, keys: Sequence[RolloutKey], new_tokens: Sequence[Sequence[int]]) -> None:
        for part in self._parts:
            part.observe_batch(keys, new_tokens)

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        for part in self._parts:
            part.finish(key, rollout)

    def reset_stats(self) -> None:
        for part in self._parts:
            part.reset_stats()

    def stats(self) -> dict:
        out = {f"prefix_{k}": v for k, v in self.prefix.stats().items()}
        out.update({f"tree_{k}": v for k, v in self.tree_cache.stats().items()})
        out["cache_bytes"] = out["prefix_cache_bytes"] + out["tree_cache_bytes"]
        return out
