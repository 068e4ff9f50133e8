"""SRT: one suffix trie per prompt with every earlier rollout of it and the in-flight tokens of its siblings.

    python -m pytest tests/test_drafters.py -q -k tree_cache

Each rollout is one trie sequence, ``[START] + response`` (START lets the first response tokens
be matched too). A started rollout gets a fresh sequence id; ``observe`` appends its tokens at
once, so the other samples of its GRPO group draft from them in the same step; at ``finish`` the
sequence simply stays as the finished rollout (it is topped up from ``rollout.token_ids`` if the
engine reported fewer tokens). An aborted rollout (start and observe, never finish; e.g. a
run-ahead request still running when its batch ended) keeps its tokens in the trie. Run-ahead
rollouts arrive through the same calls; the harness, not the drafter, schedules them.
"""
from __future__ import annotations

from typing import Sequence

from methods.base import Draft, NO_DRAFT, NullDrafter, Rollout, RolloutKey
from methods.suffix.compiled import extend_many, speculate_own_many
from methods.suffix.tree import START, ContextMatcher, SuffixTrie, make_tree, resolve_backend

MATCH_RULES = ("longest", "best")  # SRT's paper / SuffixDecoding's best score over match lengths


class TreeCacheDrafter(NullDrafter):
    """Longest-suffix drafting from the rollout's own per-prompt trie (SRT defaults).

    ``in_flight=False`` inserts rollouts only at ``finish`` (SRT's "history only" ablation);
    ``history=False`` empties the tries at every step ("in-flight only"). ``match`` picks the
    match length: ``"longest"`` (SRT's paper: the longest suffix of the context that has a
    continuation drafts, ``SuffixTrie.speculate_longest``) or ``"best"`` (SuffixDecoding's
    rule: the best score over every match length, ``SuffixTrie.speculate``).
    ``backend`` (``auto`` | ``python`` | ``native`` | ``trie``): the tries are arctic-inference's native
    suffix trees where that is installed and ``match`` is ``best`` (``auto``); the longest-match
    rule has no native form and always runs in Python (``SuffixIndex``; ``native`` refuses it).
    """

    name = "tree_cache"
    backend, _native = "python", False  # what snapshots pickled before the knob existed resume on

    def __init__(self, max_depth: int = 64, max_spec_tokens: int = 24, factor: float = 1.0,
                 offset: float = 0.0, min_prob: float = 0.1, tree: bool = False,
                 in_flight: bool = True, history: bool = True, run_ahead: bool = False,
                 match: str = "longest", backend: str = "auto"):
        if match not in MATCH_RULES:
            raise ValueError(f"match must be one of {MATCH_RULES}, got {match!r}")
        self.match = match
        self.backend = resolve_backend(backend, supported=match == "best",
                                       what=f"{type(self).__name__} with match: {match}")
        self._native = self.backend == "native"
        self.max_depth = max_depth
        self.max_spec_tokens = max_spec_tokens
        self.factor = factor
        self.offset = offset
        self.min_prob = min_prob
        self.tree = tree
        self.in_flight = in_flight
        self.history = history
        self.run_ahead = run_ahead  # recorded with the run; the harness does the scheduling
        self._tries: dict[str, SuffixTrie] = {}
        self._live: dict[RolloutKey, int] = {}  # in-flight mode: key -> its sequence id
        self._matchers: dict[RolloutKey, ContextMatcher | list[int]] = {}  # history-only mode (native: the context)
        self._next_seq = 0
        self.reset_stats()

    def reset_stats(self) -> None:
        self._proposals = 0
        self._drafts = 0
        self._draft_tokens = 0
        self._match_len_sum = 0

    def trie(self, prompt_id: str) -> SuffixTrie:
        trie = self._tries.get(prompt_id)
        if trie is None:
            trie = self._tries[prompt_id] = make_tree(self.backend, self.max_depth)
        return trie

    def begin_step(self, step: int) -> None:
        self._live.clear()  # rollouts of the last step that never finished stay in their tries
        self._matchers.clear()
        if not self.history:
            self._tries.clear()

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        trie = self.trie(key.prompt_id)
        if self.in_flight:
            self._live[key] = self._next_seq
            trie.append(self._next_seq, START)
            self._next_seq += 1
        else:
            self._matchers[key] = [START] if self._native else trie.matcher((START,))

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None:
        if self.in_flight:
            seq_id = self._live.get(key)
            if seq_id is not None:
                self._tries[key.prompt_id].extend(seq_id, new_tokens)
        else:
            matcher = self._matchers.get(key)
            if matcher is None:
                return
            if self._native:
                matcher += new_tokens
                if len(matcher) > 2 * self.max_depth:
                    del matcher[:-self.max_depth]
            else:
                matcher.feed(new_tokens)

    def observe_batch(self, keys: Sequence[RolloutKey], new_tokens: Sequence[Sequence[int]]) -> None:
        """``observe`` for each row; on the compiled in-flight tries, one call for the batch."""
        if not self.in_flight or self.backend != "compiled":
            for key, toks in zip(keys, new_tokens):
                self.observe(key, toks)
            return
        live, tries = self._live, self._tries
        ids = [live.get(k) for k in keys]
        extend_many([tries.get(k.prompt_id) for k in keys], ids, list(new_tokens))

    def propose_batch(self, keys: Sequence[RolloutKey], outputs: Sequence[Sequence[int]],
                      budgets: Sequence[int]) -> list[Draft]:
        """``propose`` for each row; on the compiled in-flight tries, one call for the batch."""
        if not self.in_flight or self.backend != "compiled":
            return [self.propose(k, o, b) for k, o, b in zip(keys, outputs, budgets)]
        self._proposals += len(keys)
        return self._compiled_drafts(keys, outputs, budgets)

    def _compiled_drafts(self, keys: Sequence[RolloutKey], outputs: Sequence[Sequence[int]],
                         limits: Sequence[int]) -> list[Draft]:
        """``_draft`` of each row (at most ``min(max_spec_tokens, limit)`` tokens) in one compiled call."""
        live, tries = self._live, self._tries
        results, drafts, tokens, match_sum = speculate_own_many(
            [tries.get(k.prompt_id) for k in keys], [live.get(k) for k in keys], list(outputs), list(limits),
            self.max_spec_tokens, self.match == "longest", self.factor, self.offset, self.min_prob, self.tree)
        self._drafts += drafts
        self._draft_tokens += tokens
        self._match_len_sum += match_sum
        return [Draft(toks, parents) if toks else NO_DRAFT for toks, parents in results]

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        """Longest-suffix draft from this prompt's trie (sibling and earlier rollouts).

        Example: an earlier rollout of the prompt was [5, 6, 7, 8]; a sibling is at output [5, 6].
        Its context [START, 5, 6] occurs once before (plus itself, which has no continuation), so
        the longest match, length 3 (budget 3), has share 1/2 for 7, then 1 for 8: it drafts
        ``Draft([7, 8])`` with score 0.5 + 0.5 = 1.0.
        The rules differ when a shorter match is more common: earlier rollouts [7, 1, 2, 9],
        [1, 2, 3, 4] twice, now at output [7, 1, 2]. The longest match [START, 7, 1, 2] (2
        occurrences, one continued by 9) drafts [9] under ``match="longest"`` (score 0.5); under
        ``match="best"`` the length-2 match [1, 2] (4 occurrences, 3 follows twice) drafts
        [3, 4] with score 0.5 + 0.5 = 1.0 and wins.
        """
        self._proposals += 1
        return self._draft(key, output, min(self.max_spec_tokens, budget))

    def _draft(self, key: RolloutKey, output: Sequence[int], limit: int) -> Draft:
        """The draft of at most ``limit`` tokens (what subclasses with other budgets call)."""
        trie = self._tries.get(key.prompt_id)
        if trie is None or limit <= 0:
            return NO_DRAFT
        if self.in_flight:
            seq_id = self._live.get(key)
            if seq_id is None:
                return NO_DRAFT
            have = trie.sequence_length(seq_id) - 1
            if have < len(output):  # the engine showed tokens it did not observe(): take them
                trie.extend(seq_id, output[have:])
            elif have > len(output):
                return NO_DRAFT
            if self._native:
                spec = trie.speculate_seq(seq_id, limit, self.factor, self.offset, self.min_prob, self.tree)
            else:
                spec = trie.speculate_own(seq_id, self.match == "longest", limit, self.factor, self.offset,
                                          self.min_prob, self.tree)
        else:
            matcher = self._matchers.get(key)
            if matcher is None:
                return NO_DRAFT
            if self._native:
                spec = trie.speculate_context(matcher, limit, self.factor, self.offset, self.min_prob, self.tree)
            else:
                rule = trie.speculate_longest if self.match == "longest" else trie.speculate
                spec = rule(matcher.matches(), limit, self.factor, self.offset, self.min_prob, self.tree)
        if spec.token_ids:
            self._drafts += 1
            self._draft_tokens += len(spec.token_ids)
            self._match_len_sum += spec.match_len
        return spec.draft()

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        trie = self.trie(key.prompt_id)
        tokens = rollout.token_ids
        self._matchers.pop(key, None)
        seq_id = self._live.pop(key, None)
        if seq_id is None:  # history-only mode, or a finish without start
            trie.extend(self._next_seq, [START, *tokens])
            self._next_seq += 1
            return
        seq = trie.sequence(seq_id)
        have = len(seq) - 1
        if seq[1:] != tokens[:have]:  # the observed tokens disagree: trust the final rollout
            trie.remove(seq_id)
            trie.extend(seq_id, [START, *tokens])
        elif have < len(tokens):
            trie.extend(seq_id, tokens[have:])

    def stats(self) -> dict:
        tries = self._tries.values()
        return {
            "prompts": len(self._tries),
            "sequences": sum(len(t) for t in tries),
            "nodes": sum(t.num_nodes for t in tries),
            "cache_bytes": sum(t.approx_bytes() for t in tries),
            "proposals": self._proposals,
            "drafts": self._drafts,
            "draft_tokens": self._draft_tokens,
            "mean_match_len": self._match_len_sum / self._drafts if self._drafts else 0.0,
        }
