"""Seer's grouped speculation (arXiv 2511.14617): one trie per GRPO group fed by every running sibling, draft budget to the tail first.

    python -m pytest tests/test_drafters.py -q -k seer

The group's trie is the tree cache's per-prompt trie (``TreeCacheDrafter``) with in-flight
inserts: each sibling's tokens enter it as they are produced, so the others draft from them.
By default it holds this step's group only (``history: false``, emptied at every step; Seer
builds its group trees from the running group); ``history: true`` keeps earlier visits too.

Budget: once per engine iteration the engine reports the live rows and their output lengths
(``begin_iteration``, the optional hook of ``methods/base.py``). The rows are ranked by output
length, longest first (ties in batch order): the requests that have run longest are the tail
that sets the step's makespan. Down that ranking each row's draft is computed with a cap of
min(``max_spec_tokens``, tokens left of ``max_batch_draft_tokens``), and its length is taken
from the pool; rows reached after the pool is spent do not draft this iteration. While the
batch is full the pool limits the verification work; once the tail remains, each of its rows
gets a full budget. ``max_batch_draft_tokens: null`` means no pool. Seer's code is not public:
the pool is this suite's reading of its marginal-benefit policy (docs/papers.md, "Newer anchors"), and
the other knobs are SRT's (depth 64, 24 tokens, factor 1.0, min_prob 0.1, longest match) so the
two differ only in what the tree holds and who gets the budget. An engine that does not call
the hook gets plain per-row drafts (counted as ``unallocated_proposals``).
"""
from __future__ import annotations

from typing import Sequence

from methods.base import Draft, NO_DRAFT, RolloutKey
from methods.suffix.tree import Speculation
from methods.tree_cache import TreeCacheDrafter


_STARVED = (0, 0, None, -1)  # a row reached after the pool was spent: (output length, cap, speculation, version)


class SeerDrafter(TreeCacheDrafter):
    """Per-group in-flight trie; a per-iteration pool of draft tokens handed out tail first."""

    name = "seer"

    def __init__(self, max_depth: int = 64, max_spec_tokens: int = 24, factor: float = 1.0,
                 offset: float = 0.0, min_prob: float = 0.1, tree: bool = False, match: str = "longest",
                 history: bool = False, max_batch_draft_tokens: int | None = 128, backend: str = "auto"):
        super().__init__(max_depth=max_depth, max_spec_tokens=max_spec_tokens, factor=factor,
                         offset=offset, min_prob=min_prob, tree=tree, in_flight=True, history=history,
                         run_ahead=False, match=match, backend=backend)
        if max_batch_draft_tokens is not None and max_batch_draft_tokens < 0:
            raise ValueError(f"max_batch_draft_tokens must be >= 0 or null, got {max_batch_draft_tokens}")
        self.max_batch_draft_tokens = max_batch_draft_tokens
        # key -> (output length, cap, precomputed speculation or None, trie version) for this iteration
        self._alloc: dict[RolloutKey, tuple[int, int, Speculation | None, int]] = {}

    def reset_stats(self) -> None:
        super().reset_stats()
        self._iterations = 0
        self._starved = 0
        self._unallocated = 0
        self._allocated_tokens = 0

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self._alloc.clear()

    def begin_iteration(self, live: Sequence[tuple[RolloutKey, int]], budget: int | None = None) -> None:
        """Rank the live rows longest output first and hand out the pool in that order; no row
        gets more than ``budget`` (the speculation policy's cap), so the pool is never spent on
        tokens the policy would cut before verifying. Once the pool is spent, the rows left are
        starved at once (one entry each, no walk of their tries)."""
        self._iterations += 1
        alloc = self._alloc = dict.fromkeys([key for key, _ in live], _STARVED)
        left = self.max_batch_draft_tokens
        most = self.max_spec_tokens if budget is None else min(self.max_spec_tokens, budget)
        lengths = [n for _, n in live]
        ranked = sorted(range(len(live)), key=lengths.__getitem__, reverse=True)  # stable: ties in batch order
        served = 0
        for i in ranked:
            cap = most if left is None else min(most, left)
            if cap <= 0:
                break
            served += 1
            key, n = live[i]
            spec = self._speculation(key, n, cap)
            trie = self._tries.get(key.prompt_id)
            alloc[key] = (n, cap, spec, trie.version if trie is not None else -1)
            if spec is not None and left is not None:
                left -= len(spec.token_ids)
                self._allocated_tokens += len(spec.token_ids)
        self._starved += len(ranked) - served

    def _speculation(self, key: RolloutKey, output_len: int, cap: int) -> Speculation | None:
        """The row's draft under ``cap`` from its group trie, or None where the trie does not
        hold exactly ``output_len`` of its tokens (then ``propose`` drafts it itself)."""
        trie = self._tries.get(key.prompt_id)
        seq_id = self._live.get(key)
        if trie is None or seq_id is None or trie.sequence_length(seq_id) - 1 != output_len:
            return None
        if self._native:
            return trie.speculate_seq(seq_id, cap, self.factor, self.offset, self.min_prob, self.tree)
        return trie.speculate_own(seq_id, self.match == "longest", cap, self.factor, self.offset, self.min_prob,
                                  self.tree)

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        """The draft allotted to this row at ``begin_iteration``.

        Example: pool 3 tokens; sibling 0 finished with [5, 6, 7, 8, 9]; sibling 1 is at
        output [5, 6, 7] and sibling 2 at [5]. Sibling 1 has run longest: its context
        [START, 5, 6, 7] drafts [8, 9] (cap 3, share 1/2 each), which leaves 1 token, so
        sibling 2 (context [START, 5], 6 follows 2 of its 3 occurrences) gets ``Draft([6])``
        instead of [6, 7]. With a pool of 2, sibling 2 gets ``Draft()``: the tail came first.
        """
        return self._allotted(key, output, budget, self._alloc.pop(key, None))

    def propose_batch(self, keys: Sequence[RolloutKey], outputs: Sequence[Sequence[int]],
                      budgets: Sequence[int]) -> list[Draft]:
        """``propose`` for each row in order; a starved row costs a lookup (most rows, once the pool is spent)."""
        pop, allotted = self._alloc.pop, self._allotted
        drafts = []
        starved = 0
        for key, output, budget in zip(keys, outputs, budgets):
            alloc = pop(key, None)
            if alloc is _STARVED:
                starved += 1
                drafts.append(NO_DRAFT)
            else:
                drafts.append(allotted(key, output, budget, alloc))
        self._proposals += starved
        return drafts

    def _allotted(self, key: RolloutKey, output: Sequence[int], budget: int,
                  alloc: tuple[int, int, Speculation | None, int] | None) -> Draft:
        """The row's draft from its allotment at ``begin_iteration`` (None: the engine did not report the batch)."""
        if alloc is None:  # the engine did not report this iteration's batch
            self._unallocated += 1
            return super().propose(key, output, budget)
        self._proposals += 1
        n, cap, spec, version = alloc
        if cap <= 0:
            return NO_DRAFT
        trie = self._tries.get(key.prompt_id)
        if spec is None or n != len(output) or budget < cap or trie is None or trie.version != version:
            return self._draft(key, output, min(cap, budget))  # the tree or the budget moved: redo
        if spec.token_ids:
            self._drafts += 1
            self._draft_tokens += len(spec.token_ids)
            self._match_len_sum += spec.match_len
        return spec.draft()

    def stats(self) -> dict:
        out = super().stats()
        out.update({"iterations": self._iterations, "starved_rows": self._starved,
                    "allocated_tokens": self._allocated_tokens, "unallocated_proposals": self._unallocated})
        return out
