"""Ours, learned: the suffix tree where its match is long, the draft model elsewhere (or the reverse).

Copying drafters are strong where the run repeats itself and silent where it does not; a draft
model drafts everywhere, less sharply. ``order: tree_first`` takes SRT's per-prompt tree draft
(``methods.tree_cache``, in-flight siblings included) when it holds at least ``tree_min_tokens``
tokens (its budget grows with the match length, so a long draft means a long match) and the draft
model's chain otherwise; ``learned_first`` takes the draft model's chain, cut where its path
probability falls below ``learned_min_prob``, and the tree where that leaves nothing. Both parts
see every call, so each keeps learning whichever drafted. Lossless under ``verify.rule: exact``.
"""
from __future__ import annotations

import math
from typing import Sequence

from methods.base import Draft, NullDrafter, Rollout, RolloutKey
from methods.tree_cache import TreeCacheDrafter

from bench.drafters.learned import DraftLMDrafter

ORDERS = ("tree_first", "learned_first")


class LearnedTreeDrafter(NullDrafter):
    """Composes TreeCacheDrafter and DraftLMDrafter; which drafts is decided row by row, iteration by iteration."""

    name = "learned_tree"
    drafts = "decoding"

    def __init__(self, order: str = "tree_first", tree_min_tokens: int = 4, learned_min_prob: float = 0.3,
                 max_spec_tokens: int = 24, learned_max_spec_tokens: int = 6, warmup_steps: int = 300,
                 update_every: int = 1, update_steps: int = 20, history_steps: int = 4, seed: int = 0):
        if order not in ORDERS:
            raise ValueError(f"order {order!r}: choose one of {ORDERS}")
        self.order, self.tree_min_tokens, self.learned_min_prob = order, tree_min_tokens, learned_min_prob
        self.tree_cache = TreeCacheDrafter(max_spec_tokens=max_spec_tokens)
        self.learned = DraftLMDrafter(max_spec_tokens=learned_max_spec_tokens, warmup_steps=warmup_steps,
                                      update_every=update_every, update_steps=update_steps,
                                      history_steps=history_steps, seed=seed)
        self._parts = (self.tree_cache, self.learned)
        self._by = {"tree": 0, "learned": 0}

    def begin_history_step(self, step: int) -> None:
        self.tree_cache.begin_step(step)
        self.learned.begin_history_step(step)

    def begin_step(self, step: int) -> None:
        for part in self._parts:
            part.begin_step(step)

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        for part in self._parts:
            part.start(key, prompt)

    def begin_iteration(self, live, budget: int | None = None) -> None:
        for part in self._parts:
            part.begin_iteration(live, budget=budget)

    def take_model_passes(self) -> dict | None:
        return self.learned.take_model_passes()

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        if self.order == "tree_first":
            tree = self.tree_cache.propose(key, output, budget)
            if len(tree) >= self.tree_min_tokens:
                self.learned.discard(key)
                return self._count("tree", tree)
            return self._count("learned", self.learned.propose(key, output, budget))
        learned = self.learned.propose(key, output, budget)
        kept = self._confident(learned)
        if len(kept):
            self.learned.verified(key, len(kept))
            return self._count("learned", kept)
        self.learned.discard(key)
        return self._count("tree", self.tree_cache.propose(key, output, budget))

    def _confident(self, d: Draft) -> Draft:
        """The draft model's chain while its path probability stays at least ``learned_min_prob``."""
        total, n = 0.0, 0
        for lp in d.logprobs or []:
            total += lp
            if math.exp(total) < self.learned_min_prob:
                break
            n += 1
        return d.truncated(n)

    def _count(self, part: str, d: Draft) -> Draft:
        if len(d):
            self._by[part] += 1
        return d

    def verified(self, key: RolloutKey, draft_len: int) -> None:
        for part in self._parts:
            part.verified(key, draft_len)

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None:
        for part in self._parts:
            part.observe(key, new_tokens)

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        for part in self._parts:
            part.finish(key, rollout)

    def reset_stats(self) -> None:
        for part in self._parts:
            part.reset_stats()
        self._by = {"tree": 0, "learned": 0}

    def stats(self) -> dict:
        out = {f"tree_{k}": v for k, v in self.tree_cache.stats().items()}
        out.update({f"learned_{k}": v for k, v in self.learned.stats().items()})
        out.update(drafts_by_tree=self._by["tree"], drafts_by_learned=self._by["learned"],
                   stale=out["learned_stale"], train_s=out["learned_train_s"],
                   acceptance=out["learned_acceptance"], parameters=out["learned_parameters"],
                   draft_vocab=out["learned_draft_vocab"])
        return out
