"""SuffixDecoding as released: one global trie of responses (the running ones included) plus each request's own prompt trie.

    python -m pytest tests/test_drafters.py -q -k suffix_global

As ArcticInference's ``SuffixDecodingCache`` does: ``start`` gives the request a trie of its own
prompt (built at its first proposal from the context so far: the same trie, never paid for by a
request that does not propose) and a slot in the global trie, evicting the oldest cached response
(FIFO) when more than ``max_cached_responses`` are held, running ones counted; every ``observe``
appends the new tokens to both (``add_active_response``), so other requests draft from a response
while it is being generated; at ``finish`` the own trie is dropped and the response stays cached
until evicted. Both tries are asked with SuffixDecoding's rule (best score over match lengths) on
the request's context (prompt + output) and the global draft wins only on a strictly higher score.
As in the native tree, match lengths stop one short of the pattern (the context's last
``max_depth`` tokens), so a context shorter than the depth is never matched whole.
``in_flight=False`` is the suite's earlier control: responses enter the global trie only when
they finish. SRT reports that a global cache slowed DAPO rollouts down: it is the negative
control for per-prompt trees.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from methods.base import Draft, NO_DRAFT, NullDrafter, Rollout, RolloutKey
from methods.suffix.compiled import extend_many, speculate_pair_many
from methods.suffix.tree import ContextMatcher, SuffixTrie, make_tree, resolve_backend  # noqa: F401 (types)

OWN = 0  # sequence id of the request inside its own trie


class SuffixGlobalDrafter(NullDrafter):
    """Global response trie + per-request prompt trie, depth 24, factor 1.0, min_prob 0.1."""

    name = "suffix_global"
    backend, _native = "python", False  # what snapshots pickled before the knob existed resume on

    def __init__(self, max_depth: int = 24, max_cached_responses: int = 10000,
                 max_spec_tokens: int = 24, factor: float = 1.0, offset: float = 0.0,
                 min_prob: float = 0.1, tree: bool = False, in_flight: bool = True, backend: str = "auto"):
        self.max_depth = max_depth
        self.max_cached_responses = max_cached_responses
        self.max_spec_tokens = max_spec_tokens
        self.factor = factor
        self.offset = offset
        self.min_prob = min_prob
        self.tree = tree
        self.in_flight = in_flight
        # native (auto, where installed): the released rule is the native tree's own call
        self.backend = resolve_backend(backend, supported=True)
        self._native = self.backend == "native"
        self.global_trie = make_tree(self.backend, max_depth)
        self._cached: deque[int] = deque()  # global sequence ids, oldest first
        self._next_seq = 0
        # a request's own trie, or its context (prompt + output) as a list until it first proposes
        self._own: dict[RolloutKey, SuffixTrie | list[int]] = {}
        self._matchers: dict[RolloutKey, ContextMatcher] = {}  # in_flight=False only
        self._prompt_len: dict[RolloutKey, int] = {}
        self._active: dict[RolloutKey, int] = {}  # in_flight: running key -> its global sequence id
        self._owner: dict[int, RolloutKey] = {}  # the reverse, to forget an evicted running response
        self.reset_stats()

    def reset_stats(self) -> None:
        self._proposals = 0
        self._drafts = 0
        self._draft_tokens = 0
        self._own_wins = 0
        self._global_wins = 0
        self._evictions = 0

    def begin_step(self, step: int) -> None:
        self._own.clear()  # requests of the last step that never finished (their responses stay cached)
        self._matchers.clear()
        self._prompt_len.clear()
        self._active.clear()
        self._owner.clear()

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        self._own[key] = list(prompt)  # the trie is built at the first proposal (_own_tree)
        self._prompt_len[key] = len(prompt)
        if not self.in_flight:
            if not self._native:  # the native call takes the context itself
                self._matchers[key] = self.global_trie.matcher(prompt)
        elif self.max_cached_responses > 0:
            old = self._active.pop(key, None)  # a restart of a running key: its response stays cached
            if old is not None:
                self._owner.pop(old, None)
            seq = self._cache_new()
            self._active[key] = seq
            self._owner[seq] = key

    def _cache_new(self) -> int:
        """A global slot for a new response; evicts the oldest cached ones beyond the cap."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._cached.append(seq)
        while len(self._cached) > self.max_cached_responses:
            old = self._cached.popleft()  # never the new one: the cap is >= 1 here
            self.global_trie.remove(old)
            owner = self._owner.pop(old, None)
            if owner is not None:  # a running response evicted: it stops growing in the global trie
                del self._active[owner]
            self._evictions += 1
        return seq

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None:
        own = self._own.get(key)
        if own is None or not new_tokens:
            return
        if type(own) is list:
            own.extend(new_tokens)
        else:
            own.extend(OWN, new_tokens)
        if not self.in_flight:
            if not self._native:
                self._matchers[key].feed(new_tokens)
        else:
            seq = self._active.get(key)
            if seq is not None:
                self.global_trie.extend(seq, new_tokens)

    def observe_batch(self, keys: Sequence[RolloutKey], new_tokens: Sequence[Sequence[int]]) -> None:
        """``observe`` for each row; in flight on the compiled tries, the own and the global
        extensions each in one call (the own tries are the rows' own, so part by part equals row
        by row)."""
        if not self.in_flight or self.backend != "compiled":
            for key, toks in zip(keys, new_tokens):
                self.observe(key, toks)
            return
        owns, active = self._own, self._active
        rows = [owns.get(k) for k in keys]
        tries = []
        for own, toks in zip(rows, new_tokens):
            if type(own) is list:
                own.extend(toks)
                tries.append(None)
            else:
                tries.append(own)
        extend_many(tries, [None if t is None else OWN for t in tries], list(new_tokens))
        g = self.global_trie
        ids = [None if own is None else active.get(k) for k, own in zip(keys, rows)]
        extend_many([g] * len(keys), ids, list(new_tokens))

    def propose_batch(self, keys: Sequence[RolloutKey], outputs: Sequence[Sequence[int]],
                      budgets: Sequence[int]) -> list[Draft]:
        """``propose`` for each row; in flight on the compiled tries, one call for the batch."""
        if not self.in_flight or self.backend != "compiled":
            return [self.propose(k, o, b) for k, o, b in zip(keys, outputs, budgets)]
        self._proposals += len(keys)
        plen, active = self._prompt_len, self._active
        results, own_wins, global_wins, drafts, tokens = speculate_pair_many(
            self.global_trie, [self._own_tree(k) for k in keys], [plen.get(k, 0) for k in keys],
            [active.get(k) for k in keys], list(outputs), list(budgets), self.max_spec_tokens, self.factor,
            self.offset, self.min_prob, self.tree)
        self._own_wins += own_wins
        self._global_wins += global_wins
        self._drafts += drafts
        self._draft_tokens += tokens
        return [Draft(toks, parents) if toks else NO_DRAFT for toks, parents in results]

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        """The better of the own-trie draft and the global-trie draft.

        Example: the global trie holds the earlier response [3, 4, 5]; a request with prompt
        [1, 2] is at output [3]. Its own trie has [1, 2, 3] (3 has no continuation there); in
        the global trie [3] occurs twice, in [3, 4, 5] and in this request's own response so
        far, so the length-1 match drafts ``Draft([4])`` (share 1/2, budget 1; [2, 3] occurs
        nowhere). With ``in_flight=False`` its own response is not there yet and 4 has share 1.
        A sibling that started at the same time and is at output [3, 4] already drafts from
        this request's tokens as they arrive (in-flight insertion).
        """
        self._proposals += 1
        own = self._own_tree(key)
        limit = min(self.max_spec_tokens, budget)
        if own is None or limit <= 0:
            return NO_DRAFT
        have = own.sequence_length(OWN) - self._prompt_len[key] if OWN in own else 0
        if have < len(output):  # tokens the engine did not observe(): take them
            self.observe(key, output[have:])
        elif have > len(output):
            return NO_DRAFT
        args = (limit, self.factor, self.offset, self.min_prob, self.tree)
        if self._native:  # the released call on both trees: the context's last max_depth tokens
            seq = own._seqs.get(OWN)
            pattern = seq[-self.max_depth:] if seq else []
            mine = own._tree.speculate(pattern, *args)  # raw native results: one Speculation at most
            theirs = self.global_trie._tree.speculate(pattern, *args)
            own_tokens, global_tokens = mine.token_ids, theirs.token_ids
            own_score = mine.score if own_tokens else 0.0
            if own_score >= (theirs.score if global_tokens else 0.0):
                if not own_tokens:
                    return NO_DRAFT
                self._own_wins += 1
                self._drafts += 1
                self._draft_tokens += len(own_tokens)
                return Draft(own_tokens, mine.parents if self.tree else None)
            self._global_wins += 1
            self._drafts += 1
            self._draft_tokens += len(global_tokens)
            return Draft(global_tokens, theirs.parents if self.tree else None)
        # as the native tree does, the longest suffix tried is one token shorter than the
        # pattern (the last max_depth tokens of the context): a context shorter than the depth
        # is never matched whole
        longest = min(self._prompt_len[key] + len(output), self.max_depth) - 1
        own_spec = own.speculate(own.own_matches(OWN)[:longest], *args)
        global_spec = self.global_trie.speculate(self._global_matches(key, own)[:longest], *args)
        return self._pick(own_spec, global_spec)

    def _own_tree(self, key: RolloutKey) -> SuffixTrie | None:
        """The request's own trie, built on first use from the context held so far: a request that
        never proposes (a fed rollout of a sparse trace, a row the speculation policy never asks)
        never pays for one. Built in one call or token by token, it is the same trie."""
        own = self._own.get(key)
        if type(own) is list:
            tokens, own = own, make_tree(self.backend, self.max_depth)
            own.extend(OWN, tokens)
            self._own[key] = own
        return own

    def _pick(self, own_spec, global_spec) -> Draft:
        """The global draft only on a strictly higher score."""
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

    def _global_matches(self, key: RolloutKey, own: SuffixTrie) -> list[int]:
        """Global-trie nodes of the suffixes of the request's context (prompt + output)."""
        if not self.in_flight:
            return self._matchers[key].matches()
        context = own.sequence_tail(OWN, self.max_depth) if OWN in own else []  # all its suffixes use
        seq = self._active.get(key)
        if seq is not None and seq in self.global_trie:  # its response is in there: start from it
            return self.global_trie.context_matches(seq, context)
        return self.global_trie.match(context)

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        self._own.pop(key, None)
        self._matchers.pop(key, None)
        self._prompt_len.pop(key, None)
        tokens = list(rollout.token_ids)
        if self.max_cached_responses <= 0:
            return
        if not self.in_flight:
            if tokens:
                self.global_trie.extend(self._cache_new(), tokens)
            return
        seq = self._active.pop(key, None)
        if seq is None:  # evicted while running, or a finish without start
            return
        del self._owner[seq]
        have = self.global_trie.sequence(seq) if seq in self.global_trie else []
        if have != tokens[:len(have)]:  # the observed tokens disagree: trust the final rollout
            self.global_trie.remove(seq)
            have = []
        if len(have) < len(tokens):
            self.global_trie.extend(seq, tokens[len(have):])

    def cached_sequence_ids(self) -> list[int]:
        return list(self._cached)

    def stats(self) -> dict:
        return {
            "cached_responses": len(self._cached),
            "global_nodes": self.global_trie.num_nodes,
            "own_tries": sum(type(t) is not list for t in self._own.values()),
            "cache_bytes": self.global_trie.approx_bytes() + sum(8 * len(t) if type(t) is list else t.approx_bytes()
                                                                 for t in self._own.values()),
            "proposals": self._proposals,
            "drafts": self._drafts,
            "draft_tokens": self._draft_tokens,
            "own_wins": self._own_wins,
            "global_wins": self._global_wins,
            "evictions": self._evictions,
        }
