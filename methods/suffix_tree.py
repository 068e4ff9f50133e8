"""The count-annotated, depth-limited suffix trie that every tree drafter shares (SRT, HistoSpec, SuffixDecoding).

    python -m pytest tests/test_suffix_tree.py -q

Every substring of length <= ``max_depth`` of the inserted sequences is a path from the root;
a node's ``count`` is how often its substring occurs (the root counts inserted tokens). Each
sequence keeps its *active nodes* (the nodes of its last ``max_depth`` suffixes), so appending a
token moves each of them one child down: O(max_depth) per token. Children are ranked by count;
ties go to the child created first (the earlier-inserted continuation), and ``node.top`` caches
the winner so drafting never sorts. Memory is O(tokens x max_depth) nodes (no path
compression); ``approx_bytes`` reports it. ``NativeSuffixTree`` wraps the compressed C++ tree of
the ``arctic_inference`` package where that is installed.
"""
from __future__ import annotations

from heapq import heappop, heappush
from typing import NamedTuple, Sequence

from .base import Draft

START = -1  # token id that marks the start of a response in per-prompt tries (never drafted)
NODE_BYTES = 72 + 224  # a slotted node plus a small dict, measured on CPython 3.11 (approximate)


class Node:
    __slots__ = ("token", "count", "children", "top", "serial")

    def __init__(self, token: int, serial: int):
        self.token = token
        self.count = 0
        self.children: dict[int, Node] = {}
        self.top: Node | None = None  # child with the highest count; ties: lowest serial
        self.serial = serial  # creation order inside the trie


class Speculation(NamedTuple):
    """A drafted chain or tree with its SuffixDecoding score (sum of path probabilities)."""

    token_ids: list[int]
    parents: list[int] | None
    score: float
    match_len: int

    def draft(self) -> Draft:
        return Draft(self.token_ids, self.parents)


NO_SPECULATION = Speculation([], None, 0.0, 0)


def _rank_top(node: Node) -> None:
    """Recompute ``node.top`` after a child's count went down (rare: only on removal)."""
    best = None
    for child in node.children.values():  # dict order is creation order: first wins ties
        if best is None or child.count > best.count:
            best = child
    node.top = best


class SuffixTrie:
    """Depth-limited suffix trie over int token sequences, each identified by an int ``seq_id``."""

    def __init__(self, max_depth: int = 64):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node(START, 0)
        self.num_nodes = 1
        self.version = 0  # bumped by every change; ContextMatcher uses it to know when to rematch
        self._serial = 1
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[Node]] = {}  # shallowest first: index i has depth i + 1

    # ----- building -----
    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequence(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id]

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
        root, max_depth = self.root, self.max_depth
        serial = self._serial
        for token in tokens:
            seq.append(token)
            root.count += 1
            active.insert(0, root)
            if len(active) > max_depth:
                active.pop()  # the suffix already at max_depth stops growing
            for i, node in enumerate(active):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node(token, serial)
                    serial += 1
                count = child.count = child.count + 1
                top = node.top
                if top is None or count > top.count or (count == top.count and child.serial < top.serial):
                    node.top = child
                active[i] = child
        self.num_nodes += serial - self._serial
        self._serial = serial
        self.version += 1

    def remove(self, seq_id: int) -> None:
        """Forget a sequence: decrement every count it added and prune nodes that reach zero."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        del self._active[seq_id]
        root, max_depth, n = self.root, self.max_depth, len(seq)
        for start in range(n):
            root.count -= 1
            node = root
            for idx in range(start, min(n, start + max_depth)):
                child = node.children.get(seq[idx])
                if child is None:
                    break
                child.count -= 1
                if child.count == 0:
                    del node.children[seq[idx]]
                    self.num_nodes -= _subtree_size(child)
                    if node.top is child:
                        _rank_top(node)
                    break
                if node.top is child:
                    _rank_top(node)
                node = child
        self.version += 1

    def approx_bytes(self) -> int:
        return self.num_nodes * NODE_BYTES + sum(8 * len(s) + 8 * len(a) for s, a in
                                                 zip(self._seqs.values(), self._active.values()))

    # ----- matching -----
    def find(self, context: Sequence[int], start: int, end: int) -> Node | None:
        """The node of ``context[start:end]``, or None if that substring never occurred."""
        node = self.root
        for idx in range(start, end):
            node = node.children.get(context[idx])
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int]) -> list[Node]:
        """Nodes of the context's suffixes of length 1, 2, ... up to the longest that occurs."""
        n = len(context)
        nodes: list[Node] = []
        for m in range(1, min(n, self.max_depth) + 1):
            node = self.find(context, n - m, n)
            if node is None:
                break
            nodes.append(node)
        return nodes

    def own_matches(self, seq_id: int) -> list[Node]:
        """For a sequence inside the trie its active nodes are its suffix matches, for free."""
        return self._active.get(seq_id, [])

    # ----- drafting -----
    def speculate(self, matches: Sequence[Node], max_spec_tokens: int, factor: float = 1.0,
                  offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
        """SuffixDecoding's rule over ``matches[m - 1]`` = node of the length-m context suffix.

        For every m the budget is min(max_spec_tokens, floor(m * factor + offset)); the draft
        follows the top child (or expands best-first with ``tree``) while the path probability
        (product of count shares) is >= min_prob; score = sum of path probabilities; the best
        score wins, ties to the longer match. Longer matches are tried first, and a shorter one
        is skipped when even budget x its first share cannot beat the best score.
        """
        best, best_score = None, 0.0
        best_m = len(matches)
        for m in range(len(matches), 0, -1):
            budget = min(max_spec_tokens, int(m * factor + offset + 1e-6))
            node = matches[m - 1]
            top = node.top
            if budget <= 0 or top is None:
                continue
            reach = budget if tree else min(budget, self.max_depth - m)
            if reach * top.count / node.count <= best_score:
                continue  # every path probability is <= the first share: cannot win
            if tree:
                tokens, parents, score = _expand_tree(node, budget, min_prob)
            else:
                tokens, score = _follow_path(node, budget, min_prob)
                parents = None
            if score > best_score:
                best, best_score, best_m = (tokens, parents), score, m
        if best is None:
            return Speculation([], None, 0.0, best_m)
        return Speculation(best[0], best[1], best_score, best_m)

    def speculate_first_hit(self, context: Sequence[int], window: int, min_match: int,
                            max_spec_tokens: int, min_prob: float) -> Speculation:
        """HistoSpec: the longest suffix of the last ``window`` tokens (>= min_match) that
        occurs with a continuation wins outright; follow its top child while prob >= min_prob."""
        n = len(context)
        for m in range(min(window, n, self.max_depth - 1), min_match - 1, -1):
            node = self.find(context, n - m, n)
            if node is not None and node.top is not None:
                tokens, score = _follow_path(node, max_spec_tokens, min_prob)
                return Speculation(tokens, None, score, m)
        return NO_SPECULATION


def _follow_path(node: Node, budget: int, min_prob: float) -> tuple[list[int], float]:
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < budget:
        child = node.top
        if child is None:
            break
        prob *= child.count / node.count
        if prob < min_prob:
            break
        tokens.append(child.token)
        score += prob
        node = child
    return tokens, score


def _expand_tree(node: Node, budget: int, min_prob: float) -> tuple[list[int], list[int], float]:
    """Best-first expansion by path probability; equal probabilities pop in push order."""
    tokens: list[int] = []
    parents: list[int] = []
    score, order = 0.0, 0
    heap: list[tuple[float, int, Node, int]] = []
    prob, parent = 1.0, -1
    while True:
        count = node.count
        for child in node.children.values():
            p = prob * (child.count / count)
            if p >= min_prob:
                heappush(heap, (-p, order, child, parent))
                order += 1
        if not heap or len(tokens) >= budget:
            break
        neg_prob, _, node, parent_index = heappop(heap)
        prob = -neg_prob
        parents.append(parent_index)
        tokens.append(node.token)
        score += prob
        parent = len(tokens) - 1
    return tokens, parents, score


def _subtree_size(node: Node) -> int:
    size, stack = 0, [node]
    while stack:
        n = stack.pop()
        size += 1
        stack.extend(n.children.values())
    return size


class ContextMatcher:
    """Suffix matches of a growing context against a trie that does not contain it.

    Feeding a token costs O(max_depth) (each matched suffix steps one child down); after the
    trie changes (its ``version`` moved) the last ``max_depth`` tokens are rematched once.
    """

    __slots__ = ("trie", "tokens", "nodes", "version")

    def __init__(self, trie: SuffixTrie, tokens: Sequence[int] = ()):
        self.trie = trie
        self.tokens: list[int] = list(tokens)[-trie.max_depth:]
        self.nodes: list[Node] = trie.match(self.tokens)
        self.version = trie.version

    def feed(self, tokens: Sequence[int]) -> None:
        trie = self.trie
        max_depth = trie.max_depth
        self.tokens.extend(tokens)
        if len(self.tokens) > 2 * max_depth:
            del self.tokens[:-max_depth]
        if self.version != trie.version:
            return  # rematched lazily in matches()
        nodes = self.nodes
        for token in tokens:
            child = trie.root.children.get(token)
            if child is None:
                nodes = []
                continue
            stepped = [child]
            for node in nodes[:max_depth - 1]:
                child = node.children.get(token)
                if child is None:
                    break
                stepped.append(child)
            nodes = stepped
        self.nodes = nodes

    def matches(self) -> list[Node]:
        if self.version != self.trie.version:
            self.nodes = self.trie.match(self.tokens[-self.trie.max_depth:])
            self.version = self.trie.version
        return self.nodes


class NativeSuffixTree:
    """The same operations on ``arctic_inference``'s compressed C++ suffix tree (optional).

    Imported lazily; raises ImportError where the package is missing. Its children are kept in
    a hash map, so ties between equal counts may be broken differently than in SuffixTrie.
    """

    def __init__(self, max_depth: int = 64):
        try:  # the module's location moved between releases
            from arctic_inference.suffix_decoding._C import SuffixTree
        except ImportError:
            from arctic_inference.suffix_decoding import SuffixTree

        self._tree = SuffixTree(max_depth)
        self.max_depth = max_depth

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        self._tree.extend(seq_id, list(tokens))

    def remove(self, seq_id: int) -> None:
        self._tree.remove(seq_id)

    def speculate(self, context: Sequence[int], max_spec_tokens: int, factor: float = 1.0,
                  offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
        d = self._tree.speculate(list(context), max_spec_tokens, factor, offset, min_prob, tree)
        return Speculation(list(d.token_ids), list(d.parents), float(d.score), int(d.match_len))
