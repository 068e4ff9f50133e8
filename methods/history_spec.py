"""RhymeRL HistoSpec: draft from a per-prompt trie of the previous visit's responses only, with AIMD draft length.

    python -m pytest tests/test_drafters.py -q -k history_spec

Responses finished during a visit (a step) are collected; at the next ``begin_step`` (or, for a
caller that never calls it, the prompt's first ``start`` in a later step) the prompt's trie is
rebuilt from them alone and stays static while its next visit runs. Each response is its own
sequence ``[START] + response``, so a draft stops where a response ended. The draft length per
rollout starts at ``min_spec_tokens``, doubles (up to ``max_spec_tokens``) after a draft that was
accepted whole, and halves otherwise; acceptance is read from ``observe`` (accepted draft tokens
followed by one sampled token).

``backend`` (``auto`` | ``python`` | ``native`` | ``trie``): the tries are arctic-inference's
native suffix trees where that is installed (``auto``; the first hit is found with forced
single-length native calls, ``NativeSuffixTree.speculate_first_hit``), else the pure-Python
``SuffixIndex``; ``trie`` is the reference ``SuffixTrie``. Drafts are the same on every backend
except where equal counts tie (the native tree's hash-map order).
"""
from __future__ import annotations

from typing import Sequence

from methods.base import Draft, NO_DRAFT, NullDrafter, Rollout, RolloutKey
from methods.prefix_reuse import common_prefix_len
from methods.suffix.tree import START, SuffixTrie, make_tree, resolve_backend


class HistorySpecDrafter(NullDrafter):
    """First-hit pattern matching (window 7, min match 4, min_prob 0.1) with AIMD length 2..16."""

    name = "history_spec"
    backend = "trie"  # what snapshots pickled before the knob existed resume on

    def __init__(self, window: int = 7, min_match: int = 4, min_prob: float = 0.1,
                 min_spec_tokens: int = 2, max_spec_tokens: int = 16, max_depth: int = 24,
                 backend: str = "auto"):
        if max_depth < window + max_spec_tokens:
            raise ValueError(f"max_depth={max_depth} must be >= window + max_spec_tokens "
                             f"= {window + max_spec_tokens} or drafts get cut by the trie depth")
        self.backend = resolve_backend(backend, supported=True)
        self.window = window
        self.min_match = min_match
        self.min_prob = min_prob
        self.min_spec_tokens = min_spec_tokens
        self.max_spec_tokens = max_spec_tokens
        self.max_depth = max_depth
        self._step = 0
        self._tries: dict[str, SuffixTrie] = {}  # drafted from: the last completed visit
        # visit in progress: (step, [(sample index, response)]), put in sample order when the trie is built
        self._collected: dict[str, tuple[int, list[tuple[int, list[int]]]]] = {}
        self._length: dict[RolloutKey, int] = {}  # AIMD draft length per rollout
        self._last_draft: dict[RolloutKey, list[int]] = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        self._proposals = 0
        self._drafts = 0
        self._draft_tokens = 0
        self._grow = 0
        self._shrink = 0

    def begin_step(self, step: int) -> None:
        """A new step: every prompt's trie of a finished visit is rebuilt now, between steps (off a
        rollout's clock, as RhymeRL builds its history between steps), not at the prompt's first
        ``start`` (measured: 7.7 ms of a 0.7 s step of the main job, results/LOG.md)."""
        self._step = step
        self._length.clear()
        self._last_draft.clear()
        for prompt_id in [p for p, (visit, _) in self._collected.items() if visit < step]:
            self._rebuild_if_new_visit(prompt_id)

    def _rebuild_if_new_visit(self, prompt_id: str) -> None:
        collected = self._collected.get(prompt_id)
        if collected is None or collected[0] >= self._step:
            return
        trie = make_tree(self.backend, self.max_depth)
        # in sample order, not finish order: "first hit" breaks ties by insertion, and the order rows
        # finish in depends on how fast each was drafted (a replay's speculation, a sparse trace's feed)
        entries = collected[1]
        if entries and not isinstance(entries[0], tuple):  # a snapshot from before sample order: as it was
            entries = list(enumerate(entries))
        for seq_id, (_, response) in enumerate(sorted(entries, key=lambda sr: sr[0])):
            trie.extend(seq_id, [START, *response])
        self._tries[prompt_id] = trie
        del self._collected[prompt_id]

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        self._rebuild_if_new_visit(key.prompt_id)
        self._length[key] = self.min_spec_tokens
        self._last_draft.pop(key, None)

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        """The continuation of the longest hit of the last ``window`` tokens (>= ``min_match``).

        Example: last visit's responses were [1, 2, 3, 4, 5, 6] and [9, 2, 3, 4, 7], AIMD
        length 2. Output [8, 2, 3, 4]: pattern [START, 8, 2, 3, 4] and its 4-suffix [8, 2, 3, 4]
        never occurred, and [2, 3, 4] is shorter than min_match, so ``Draft([])``. Output
        [1, 2, 3]: pattern [START, 1, 2, 3] hits and drafts ``Draft([4, 5])``.
        """
        self._proposals += 1
        trie = self._tries.get(key.prompt_id)
        length = min(self._length.get(key, self.min_spec_tokens), budget)
        if trie is None or length <= 0:
            return NO_DRAFT
        if len(output) >= self.window:
            context = output[-self.window:]
        else:
            context = [START, *output]
        spec = trie.speculate_first_hit(context, self.window, self.min_match, length, self.min_prob)
        if not spec.token_ids:
            return NO_DRAFT
        self._drafts += 1
        self._draft_tokens += len(spec.token_ids)
        self._last_draft[key] = spec.token_ids
        return spec.draft()

    def verified(self, key: RolloutKey, draft_len: int) -> None:
        """The policy verified only the first ``draft_len`` tokens of the last draft: AIMD judges those."""
        draft = self._last_draft.pop(key, None)
        if draft is not None and draft_len > 0:  # a draft cut to nothing was not verified: no verdict
            self._last_draft[key] = draft[:draft_len]

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None:
        draft = self._last_draft.pop(key, None)
        if draft is None:
            return
        length = self._length.get(key, self.min_spec_tokens)
        if common_prefix_len(new_tokens, draft) == len(draft):
            self._length[key] = min(2 * length, self.max_spec_tokens)
            self._grow += 1
        else:
            self._length[key] = max(length // 2, self.min_spec_tokens)
            self._shrink += 1

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        self._rebuild_if_new_visit(key.prompt_id)
        collected = self._collected.setdefault(key.prompt_id, (self._step, []))
        collected[1].append((key.sample_idx, list(rollout.token_ids)))
        self._length.pop(key, None)
        self._last_draft.pop(key, None)

    def draft_length(self, key: RolloutKey) -> int:
        return self._length.get(key, self.min_spec_tokens)

    def stats(self) -> dict:
        tries = self._tries.values()
        return {
            "prompts": len(self._tries),
            "sequences": sum(len(t) for t in tries),
            "nodes": sum(t.num_nodes for t in tries),
            "cache_bytes": sum(t.approx_bytes() for t in tries),
            "collected_responses": sum(len(r) for _, r in self._collected.values()),
            "proposals": self._proposals,
            "drafts": self._drafts,
            "draft_tokens": self._draft_tokens,
            "aimd_grow": self._grow,
            "aimd_shrink": self._shrink,
        }
