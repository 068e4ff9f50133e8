"""The reference suffix structure: a count-annotated, depth-limited trie (``backend: trie``), and
ContextMatcher, which follows a growing context through it. Memory O(tokens x max_depth) nodes;
the pure-Python default is the suffix automaton of ``methods.suffix.index`` (same drafts)."""
from __future__ import annotations

from heapq import heappop, heappush
from typing import Sequence

from methods.suffix.speculation import NO_SPECULATION, START, Speculation

ROOT = 0  # node id of the root
STRIDE = 1 << 32  # edge key = parent * STRIDE + token + 1; token ids must lie in [-1, 2**32 - 1)
NODE_BYTES = 6 * 8 + 100  # six list slots plus one edge-dict entry with its int key and value


class SuffixTrie:
    """Depth-limited suffix trie over int token sequences, each identified by an int ``seq_id``.

    Nodes are int ids into flat lists (count, top child, token, creation serial, first child,
    next sibling) and edges live in one int-keyed dict: no object per node, so building a large
    trie neither allocates containers nor wakes Python's cyclic garbage collector.
    """

    def __init__(self, max_depth: int = 64):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._edge: dict[int, int] = {}
        self._count = [0]
        self._top = [-1]  # child with the highest count; ties: lowest serial (created first)
        self._token = [START]
        self._serial = [0]
        self._first = [-1]  # first child (children form a singly linked sibling list)
        self._next = [-1]  # next sibling
        self._free: list[int] = []  # ids of pruned nodes, reused
        self._next_serial = 1
        self.num_nodes = 1
        self.version = 0  # bumped by every change; ContextMatcher uses it to know when to rematch
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[int]] = {}  # shallowest first: index i has depth i + 1

    # ----- inspection -----
    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequence(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id]

    def sequence_length(self, seq_id: int) -> int:
        return len(self._seqs[seq_id])

    def sequence_tail(self, seq_id: int, n: int) -> list[int]:
        """The last ``n`` tokens of a sequence (a new list): a context's suffixes, without copying it all."""
        return self._seqs[seq_id][-n:] if n > 0 else []

    def count_of(self, node: int) -> int:
        return self._count[node]

    def top_child(self, node: int) -> int | None:
        top = self._top[node]
        return None if top < 0 else top

    def children(self, node: int) -> dict[int, int]:
        """{token: child node} in creation order."""
        kids = []
        child = self._first[node]
        while child >= 0:
            kids.append(child)
            child = self._next[child]
        kids.sort(key=self._serial.__getitem__)
        return {self._token[c]: c for c in kids}

    def approx_bytes(self) -> int:
        return len(self._count) * NODE_BYTES + sum(8 * len(s) + 8 * len(a) for s, a in
                                                   zip(self._seqs.values(), self._active.values()))

    # ----- building -----
    def _new_node(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self._count[node] = 0
            self._top[node] = -1
            self._token[node] = token
            self._serial[node] = self._next_serial
            self._first[node] = -1
        else:
            node = len(self._count)
            self._count.append(0)
            self._top.append(-1)
            self._token.append(token)
            self._serial.append(self._next_serial)
            self._first.append(-1)
            self._next.append(-1)
        self._next_serial += 1
        self._next[node] = self._first[parent]
        self._first[parent] = node
        self.num_nodes += 1
        return node

    def append(self, seq_id: int, token: int) -> None:
        self.extend(seq_id, (token,))

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append tokens to a sequence (new or existing), O(max_depth) per token."""
        if not tokens:
            return
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = []
            self._active[seq_id] = []
        active = self._active[seq_id]
        edge, count, top, serial = self._edge, self._count, self._top, self._serial
        max_depth = self.max_depth
        for token in tokens:
            seq.append(token)
            count[ROOT] += 1
            active.insert(0, ROOT)
            if len(active) > max_depth:
                active.pop()  # the suffix already at max_depth stops growing
            key_token = token + 1
            for i, node in enumerate(active):
                key = node * STRIDE + key_token
                child = edge.get(key)
                if child is None:
                    child = edge[key] = self._new_node(node, token)
                c = count[child] + 1
                count[child] = c
                t = top[node]
                if t < 0 or c > count[t] or (c == count[t] and serial[child] < serial[t]):
                    top[node] = child
                active[i] = child
        self.version += 1

    def remove(self, seq_id: int) -> None:
        """Forget a sequence: decrement every count it added and prune nodes that reach zero."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        del self._active[seq_id]
        edge, count, top = self._edge, self._count, self._top
        max_depth, n = self.max_depth, len(seq)
        for start in range(n):
            count[ROOT] -= 1
            node = ROOT
            for idx in range(start, min(n, start + max_depth)):
                key = node * STRIDE + seq[idx] + 1
                child = edge.get(key)
                if child is None:
                    break
                count[child] -= 1
                if count[child] == 0:
                    del edge[key]
                    self._unlink(node, child)
                    self._free_subtree(child)
                    if top[node] == child:
                        self._rank_top(node)
                    break
                if top[node] == child:
                    self._rank_top(node)
                node = child
        self.version += 1

    def _rank_top(self, node: int) -> None:
        """Recompute a node's top child after a child's count went down (only on removal)."""
        count, serial = self._count, self._serial
        best = -1
        child = self._first[node]
        while child >= 0:
            if best < 0 or count[child] > count[best] or (
                    count[child] == count[best] and serial[child] < serial[best]):
                best = child
            child = self._next[child]
        self._top[node] = best

    def _unlink(self, parent: int, node: int) -> None:
        nxt = self._next
        if self._first[parent] == node:
            self._first[parent] = nxt[node]
            return
        prev = self._first[parent]
        while nxt[prev] != node:
            prev = nxt[prev]
        nxt[prev] = nxt[node]

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            child = self._first[n]
            while child >= 0:
                del self._edge[n * STRIDE + self._token[child] + 1]
                stack.append(child)
                child = self._next[child]
            self._free.append(n)
            self.num_nodes -= 1

    # ----- matching -----
    def find(self, context: Sequence[int], start: int, end: int) -> int | None:
        """The node of ``context[start:end]``, or None if that substring never occurred."""
        edge = self._edge
        node = ROOT
        for idx in range(start, end):
            node = edge.get(node * STRIDE + context[idx] + 1)
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int]) -> list[int]:
        """Nodes of the context's suffixes of length 1, 2, ... up to the longest that occurs."""
        n = len(context)
        nodes: list[int] = []
        for m in range(1, min(n, self.max_depth) + 1):
            node = self.find(context, n - m, n)
            if node is None:
                break
            nodes.append(node)
        return nodes

    def matcher(self, tokens: Sequence[int] = ()) -> "ContextMatcher":
        """A ``ContextMatcher`` of a context that is not in the trie."""
        return ContextMatcher(self, tokens)

    def own_matches(self, seq_id: int) -> list[int]:
        """For a sequence inside the trie its active nodes are its suffix matches, for free."""
        return self._active.get(seq_id, [])

    def context_matches(self, seq_id: int, context: Sequence[int]) -> list[int]:
        """``match(context)`` for a context that ends with sequence ``seq_id`` of this trie.

        The sequence's active nodes give the suffixes up to its own length for free; only when
        it is shorter than ``max_depth`` and the context is longer (a response just begun,
        after its prompt) are the longer suffixes looked up, until one never occurred.
        """
        nodes = self._active.get(seq_id)
        if nodes is None:
            return self.match(context)
        n, k = len(context), len(nodes)
        limit = min(n, self.max_depth)
        if k >= limit:
            return nodes
        out = list(nodes)
        for m in range(k + 1, limit + 1):
            node = self.find(context, n - m, n)
            if node is None:
                break
            out.append(node)
        return out

    # ----- drafting -----
    def speculate(self, matches: Sequence[int], max_spec_tokens: int, factor: float = 1.0,
                  offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
        """SuffixDecoding's rule over ``matches[m - 1]`` = node of the length-m context suffix.

        For every m the budget is min(max_spec_tokens, floor(m * factor + offset)); the draft
        follows the top child (or expands best-first with ``tree``) while the path probability
        (product of count shares) is >= min_prob; score = sum of path probabilities; the best
        score wins, ties to the longer match. Longer matches are tried first, and a shorter one
        is skipped when even budget x its first share cannot beat the best score.
        """
        count, top = self._count, self._top
        best, best_score = None, 0.0
        best_m = len(matches)
        for m in range(len(matches), 0, -1):
            budget = min(max_spec_tokens, int(m * factor + offset + 1e-6))
            node = matches[m - 1]
            first = top[node]
            if budget <= 0 or first < 0:
                continue
            reach = budget if tree else min(budget, self.max_depth - m)
            if reach * count[first] / count[node] <= best_score:
                continue  # every path probability is <= the first share: cannot win
            if tree:
                tokens, parents, score = self._expand_tree(node, budget, min_prob)
            else:
                tokens, score = self._follow_path(node, budget, min_prob)
                parents = None
            if score > best_score:
                best, best_score, best_m = (tokens, parents), score, m
        if best is None:
            return Speculation([], None, 0.0, best_m)
        return Speculation(best[0], best[1], best_score, best_m)

    def speculate_longest(self, matches: Sequence[int], max_spec_tokens: int, factor: float = 1.0,
                          offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
        """SRT's rule: draft from the longest match that has a continuation, whatever its score.

        Same budget (min(max_spec_tokens, floor(m * factor + offset))), path and min_prob rules
        as ``speculate``, but no comparison across match lengths: the longest m whose node has a
        child and a positive budget wins outright (its draft may still be empty under min_prob).
        """
        for m in range(len(matches), 0, -1):
            node = matches[m - 1]
            budget = min(max_spec_tokens, int(m * factor + offset + 1e-6))
            if budget <= 0 or self._top[node] < 0:
                continue
            if tree:
                tokens, parents, score = self._expand_tree(node, budget, min_prob)
            else:
                (tokens, score), parents = self._follow_path(node, budget, min_prob), None
            return Speculation(tokens, parents if tokens else None, score, m)
        return NO_SPECULATION

    def speculate_own(self, seq_id: int, longest: bool, max_spec_tokens: int, factor: float = 1.0,
                      offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
        """``speculate_longest`` (``longest``) or ``speculate`` of ``own_matches(seq_id)``: the
        in-flight drafters' one call (the compiled index answers it without building the list)."""
        rule = self.speculate_longest if longest else self.speculate
        return rule(self.own_matches(seq_id), max_spec_tokens, factor, offset, min_prob, tree)

    def speculate_first_hit(self, context: Sequence[int], window: int, min_match: int,
                            max_spec_tokens: int, min_prob: float) -> Speculation:
        """HistoSpec: the longest suffix of the last ``window`` tokens (>= min_match) that
        occurs with a continuation wins outright; follow its top child while prob >= min_prob."""
        n = len(context)
        for m in range(min(window, n, self.max_depth - 1), min_match - 1, -1):
            node = self.find(context, n - m, n)
            if node is not None and self._top[node] >= 0:
                tokens, score = self._follow_path(node, max_spec_tokens, min_prob)
                return Speculation(tokens, None, score, m)
        return NO_SPECULATION

    def _follow_path(self, node: int, budget: int, min_prob: float) -> tuple[list[int], float]:
        count, top, token = self._count, self._top, self._token
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < budget:
            child = top[node]
            if child < 0:
                break
            prob *= count[child] / count[node]
            if prob < min_prob:
                break
            tokens.append(token[child])
            score += prob
            node = child
        return tokens, score

    def _expand_tree(self, node: int, budget: int, min_prob: float) -> tuple[list[int], list[int], float]:
        """Best-first expansion by path probability; equal probabilities: earlier-created first."""
        count, serial, first, nxt = self._count, self._serial, self._first, self._next
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        heap: list[tuple[float, int, int, int]] = []
        prob, parent = 1.0, -1
        while True:
            total = count[node]
            child = first[node]
            while child >= 0:
                p = prob * (count[child] / total)
                if p >= min_prob:
                    heappush(heap, (-p, serial[child], child, parent))
                child = nxt[child]
            if not heap or len(tokens) >= budget:
                break
            neg_prob, _, node, parent_index = heappop(heap)
            prob = -neg_prob
            parents.append(parent_index)
            tokens.append(self._token[node])
            score += prob
            parent = len(tokens) - 1
        return tokens, parents, score


class ContextMatcher:
    """Suffix matches of a growing context against a trie that does not contain it.

    Feeding a token costs O(max_depth) (each matched suffix steps one child down); after the
    trie changes (its ``version`` moved) the last ``max_depth`` tokens are rematched once.
    """

    __slots__ = ("trie", "tokens", "nodes", "version")

    def __init__(self, trie: SuffixTrie, tokens: Sequence[int] = ()):
        self.trie = trie
        self.tokens: list[int] = list(tokens)[-trie.max_depth:]
        self.nodes: list[int] = trie.match(self.tokens)
        self.version = trie.version

    def feed(self, tokens: Sequence[int]) -> None:
        trie = self.trie
        max_depth = trie.max_depth
        self.tokens.extend(tokens)
        if len(self.tokens) > 2 * max_depth:
            del self.tokens[:-max_depth]
        if self.version != trie.version:
            return  # rematched lazily in matches()
        edge = trie._edge
        nodes = self.nodes
        for token in tokens:
            key_token = token + 1
            child = edge.get(ROOT * STRIDE + key_token)
            if child is None:
                nodes = []
                continue
            stepped = [child]
            for node in nodes[:max_depth - 1]:
                child = edge.get(node * STRIDE + key_token)
                if child is None:
                    break
                stepped.append(child)
            nodes = stepped
        self.nodes = nodes

    def matches(self) -> list[int]:
        if self.version != self.trie.version:
            self.nodes = self.trie.match(self.tokens[-self.trie.max_depth:])
            self.version = self.trie.version
        return self.nodes


