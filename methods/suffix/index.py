"""The tree drafters' pure-Python index: the depth-limited suffix trie's matches and drafts, read off a counted suffix automaton.

    python -m pytest tests/test_suffix_index.py -q

``SuffixTrie`` (``methods/suffix/trie.py``) is the reference: every substring of length <=
``max_depth`` is a node, so it holds about ``max_depth`` nodes per token of varied text (9 KB a
token at depth 64) and an append touches ``max_depth`` nodes. ``SuffixIndex`` answers the same
questions from the counted suffix automaton of ``methods/suffix/automaton.py`` (construction,
counts, removal, compaction, and why its states are the trie's nodes): at most two states per
token, whatever the depth.

Drafting is the trie's rule for rule (``speculate``, ``speculate_longest``,
``speculate_first_hit``, chains and best-first trees, the same float operations in the same
order): ``tests/test_suffix_index.py`` checks the drafts against ``SuffixTrie`` call by call,
removals, ties and trees included. Matches are lists of states, ``matches[m - 1]`` the state of
the length-m suffix, as the trie's lists of nodes are.
"""
from __future__ import annotations

from heapq import heappop, heappush
from typing import Sequence

from methods.suffix.automaton import NO_MORE, NO_TOKEN, UNKNOWN, CountedSuffixAutomaton
from methods.suffix.speculation import NO_SPECULATION, Speculation


class SuffixIndex(CountedSuffixAutomaton):
    """Counted generalised suffix automaton, queried as a depth-``max_depth`` suffix trie.

    Same interface as ``SuffixTrie`` for the drafters (``extend``/``append``/``remove``,
    ``sequence``, ``own_matches``, ``match``, ``context_matches``, ``matcher``, ``speculate``,
    ``speculate_longest``, ``speculate_first_hit``, ``version``); node ids are state ids. Token
    ids must fit in a signed 32-bit int.

    Example: sequences [1, 2, 3] and [1, 2, 4] at depth 8: ``match([1, 2])`` is the states of
    [2] and [1, 2] (one state: both occur twice, always at the same places), both continue
    with 3 and with 4 once each; the top child is 3 (equal counts: created first).
    """

    # ----- matching -----
    def _state_of_suffix(self, state: int, n: int) -> int:
        """The state holding the length-``n`` suffix of a string of ``state`` (links walked)."""
        link, length = self._link, self._len
        while True:
            k = link[state]
            if k < 0 or length[k] < n:
                return state
            state = k

    def _chain(self, state: int, m: int) -> list[int]:
        """[state of the length-1 suffix, ..., length-m] of a string of ``state`` of length m."""
        link, length = self._link, self._len
        out = [0] * m
        while m > 0:
            lo = length[link[state]]
            out[lo:m] = [state] * (m - lo)
            m, state = lo, link[state]
        return out

    def _longest_live(self, context: Sequence[int], start: int, end: int) -> tuple[int, int]:
        """(state, length) of the longest suffix of context[start:end] that occurs live."""
        length, link, tok, to, more, count = self._len, self._link, self._tok, self._to, self._more, self._count
        v, n = 0, 0
        for idx in range(start, end):
            c = context[idx]
            while True:
                x = to[v] if tok[v] == c else more.get(v, NO_MORE).get(c, -1)
                if x >= 0:
                    v, n = x, n + 1
                    break
                if v == 0:
                    break
                v = link[v]
                n = length[v]
        while n > 0 and count[v] <= 0:
            v = link[v]
            n = length[v]
        return v, n

    def match(self, context: Sequence[int]) -> list[int]:
        """States of the context's suffixes of length 1, 2, ... up to the longest that occurs."""
        n = len(context)
        v, m = self._longest_live(context, max(0, n - self.max_depth), n)
        return self._chain(v, m)

    def own_matches(self, seq_id: int) -> list[int]:
        """The states of a sequence's own suffixes up to ``max_depth`` (the trie's active nodes)."""
        seq = self._seqs.get(seq_id)
        if not seq:
            return []
        m = min(len(seq), self.max_depth)
        return self._chain(self._state_of_suffix(self._deep[seq_id], m), m)

    def context_matches(self, seq_id: int, context: Sequence[int]) -> list[int]:
        """``match(context)`` for a context that ends with sequence ``seq_id`` of this index."""
        seq = self._seqs.get(seq_id)
        if seq is None or len(seq) < min(len(context), self.max_depth):
            return self.match(context)
        return self.own_matches(seq_id)

    def matcher(self, tokens: Sequence[int] = ()) -> "IndexMatcher":
        return IndexMatcher(self, tokens)

    # ----- drafting -----
    def _path(self, node: int, steps: int, min_prob: float) -> tuple[list[int], list[float]]:
        """The top-child path from ``node`` (at most ``steps`` tokens, path probability >=
        min_prob) and the running score after each token."""
        count, last_tok, top = self._count, self._last_tok, self._top
        tokens: list[int] = []
        scores: list[float] = []
        prob, score = 1.0, 0.0
        while len(tokens) < steps:
            child = top[node]
            if child == UNKNOWN:
                child = self._top_of(node)
            if child < 0:
                break
            prob *= count[child] / count[node]
            if prob < min_prob:
                break
            tokens.append(last_tok[child])
            score += prob
            scores.append(score)
            node = child
        return tokens, scores

    def speculate(self, matches: Sequence[int], max_spec_tokens: int, factor: float = 1.0,
                  offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
        """``SuffixTrie.speculate``: SuffixDecoding's best score over match lengths, ties to the
        longer match, with the trie's pruning. One state holds a run of match lengths with the
        same counts and continuations: its top child is looked up once, and a chain's path (the
        same for every length of the state, only its length cap differs) is followed once."""
        count, length, link = self._count, self._len, self._link
        depth = self.max_depth
        best, best_score = None, 0.0
        best_m = len(matches)
        m = min(len(matches), depth - 1)  # a match of length max_depth has no continuation
        while m > 0:
            node = matches[m - 1]
            lo = length[link[node]]  # this state holds the match lengths lo + 1 .. m here
            first = self._top_of(node)
            if first < 0:
                m = lo
                continue
            share = count[first]
            total = count[node]
            path_tokens: list[int] = []
            path_scores: list[float] = []
            path_steps = -1
            while m > lo:
                budget = min(max_spec_tokens, int(m * factor + offset + 1e-6))
                if budget <= 0:
                    m -= 1
                    continue
                reach = budget if tree else min(budget, depth - m)
                if reach * share / total <= best_score:
                    m -= 1
                    continue
                if tree:
                    tokens, parents, score = self._expand_tree(node, m, budget, min_prob)
                else:
                    steps = min(budget, depth - m)
                    if steps > path_steps and len(path_tokens) == max(path_steps, 0):
                        path_tokens, path_scores = self._path(node, steps, min_prob)
                        path_steps = steps
                    k = min(steps, len(path_tokens))
                    tokens, score, parents = path_tokens[:k], path_scores[k - 1] if k else 0.0, None
                if score > best_score:
                    best, best_score, best_m = (tokens, parents), score, m
                m -= 1
        if best is None:
            return Speculation([], None, 0.0, best_m)
        return Speculation(best[0], best[1], best_score, best_m)

    def speculate_longest(self, matches: Sequence[int], max_spec_tokens: int, factor: float = 1.0,
                          offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
        """``SuffixTrie.speculate_longest``: the longest match with a continuation drafts (the
        match lengths of one state share their continuations: one lookup per state)."""
        length, link = self._len, self._link
        depth = self.max_depth
        m = min(len(matches), depth - 1)
        while m > 0:
            node = matches[m - 1]
            lo = length[link[node]]
            if self._top_of(node) < 0:
                m = lo
                continue
            while m > lo:
                budget = min(max_spec_tokens, int(m * factor + offset + 1e-6))
                if budget > 0:
                    if tree:
                        tokens, parents, score = self._expand_tree(node, m, budget, min_prob)
                    else:
                        tokens, scores = self._path(node, min(budget, depth - m), min_prob)
                        score, parents = (scores[-1] if scores else 0.0), None
                    return Speculation(tokens, parents if tokens else None, score, m)
                m -= 1
        return NO_SPECULATION

    def speculate_own(self, seq_id: int, longest: bool, max_spec_tokens: int, factor: float = 1.0,
                      offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
        """``speculate_longest`` (``longest``) or ``speculate`` of ``own_matches(seq_id)``: the
        in-flight drafters' one call (the compiled index answers it without building the list)."""
        rule = self.speculate_longest if longest else self.speculate
        return rule(self.own_matches(seq_id), max_spec_tokens, factor, offset, min_prob, tree)

    def speculate_first_hit(self, context: Sequence[int], window: int, min_match: int,
                            max_spec_tokens: int, min_prob: float) -> Speculation:
        """``SuffixTrie.speculate_first_hit`` (HistoSpec): the longest suffix of the last
        ``window`` tokens (>= min_match) with a continuation wins outright."""
        n = len(context)
        longest = min(window, n, self.max_depth - 1)
        if longest < min_match:
            return NO_SPECULATION
        v, m = self._longest_live(context, n - longest, n)
        if m < min_match:
            return NO_SPECULATION
        link, length = self._link, self._len
        while m >= min_match:
            if self._top_of(v) >= 0:
                tokens, scores = self._path(v, min(max_spec_tokens, self.max_depth - m), min_prob)
                return Speculation(tokens, None, scores[-1] if scores else 0.0, m)
            if v == 0:
                break
            v = link[v]
            m = length[v]
        return NO_SPECULATION

    def _expand_tree(self, node: int, m: int, budget: int, min_prob: float) -> tuple[list[int], list[int], float]:
        """Best-first expansion by path probability; equal probabilities: the earlier-created
        node first (time, then depth: the trie's creation order)."""
        count, when, tok, to, more = self._count, self._time, self._tok, self._to, self._more
        depth = self.max_depth
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        heap: list[tuple[float, int, int, int, int]] = []
        prob, parent, d = 1.0, -1, m
        while True:
            if d < depth:
                total = count[node]
                kids = [to[node]] if tok[node] != NO_TOKEN else []
                extra = more.get(node)
                if extra is not None:
                    kids += extra.values()
                for child in kids:
                    c = count[child]
                    if c <= 0:
                        continue
                    p = prob * (c / total)
                    if p >= min_prob:
                        heappush(heap, (-p, when[child], d + 1, child, parent))
            if not heap or len(tokens) >= budget:
                break
            neg_prob, _, d, node, parent_index = heappop(heap)
            prob = -neg_prob
            parents.append(parent_index)
            tokens.append(self._last_tok[node])
            score += prob
            parent = len(tokens) - 1
        return tokens, parents, score


class IndexMatcher:
    """``ContextMatcher`` on a ``SuffixIndex``: the suffix matches of a growing context that is
    not in the index. Feeding a token is amortised O(1) (one automaton step); after the index
    changed (its ``version`` moved) the last ``max_depth`` tokens are matched again, once."""

    __slots__ = ("index", "tokens", "state", "n", "version")

    def __init__(self, index: SuffixIndex, tokens: Sequence[int] = ()):
        self.index = index
        self.tokens: list[int] = list(tokens)[-index.max_depth:]
        self._rematch()

    def _rematch(self) -> None:
        index, n = self.index, len(self.tokens)
        self.state, self.n = index._longest_live(self.tokens, max(0, n - index.max_depth), n)
        self.version = index.version

    def feed(self, tokens: Sequence[int]) -> None:
        index = self.index
        depth = index.max_depth
        self.tokens.extend(tokens)
        if len(self.tokens) > 2 * depth:
            del self.tokens[:-depth]
        if self.version != index.version:
            return  # rematched lazily in matches()
        length, link, tok, to, more, count = index._len, index._link, index._tok, index._to, index._more, index._count
        v, n = self.state, self.n
        for c in tokens:
            while True:
                x = to[v] if tok[v] == c else more.get(v, NO_MORE).get(c, -1)
                if x >= 0 and count[x] > 0:
                    v, n = x, n + 1
                    break
                if v == 0:
                    break
                v = link[v]
                n = length[v]
            if n > depth:
                n = depth
                v = index._state_of_suffix(v, n)
        self.state, self.n = v, n

    def matches(self) -> list[int]:
        if self.version != self.index.version:
            self._rematch()
        return self.index._chain(self.state, self.n)
