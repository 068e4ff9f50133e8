"""The two oracles' building blocks: the future oracle's drafter, and the cache oracle's automaton.

``OracleDrafter`` (the *future* oracle) drafts a rollout's own future from an earlier run with the
same seed: under coupled sampling a baseline run with the same seed produces exactly the tokens the
current run will produce, so drafting them bounds what any drafter can gain on an engine. Used by
tests, by ``python -m bench.benchmarks oracle`` and (as ``future_oracle``) by ``bench.harness.simulate``.

``SuffixAutomaton`` holds the texts a *cache* oracle may copy from (``bench.harness.sim_cache_oracle``'s
``cache_oracle_tokens_per_step``: the best any copying drafter could do with a method's cache
contents and budget), in memory linear in the tokens.
"""
from __future__ import annotations

from array import array
from typing import Mapping, Sequence

from methods.base import Draft, NO_DRAFT, NullDrafter, RolloutKey


class OracleDrafter(NullDrafter):
    """Drafts ``futures[key][len(output):]`` while the output still agrees with it.

    Example: futures {k: [4, 9, 2, 0]}, output [4], budget 2 -> Draft([9, 2]).
    After the output diverges (say [4, 7]) it drafts nothing for that rollout.
    """

    name = "oracle"

    def __init__(self, futures: Mapping[RolloutKey, Sequence[int]], max_spec_tokens: int | None = None):
        self.futures = {k: list(v) for k, v in futures.items()}
        self.max_spec_tokens = max_spec_tokens
        self._agrees: dict[RolloutKey, int] = {}  # key -> output length known to agree, -1 diverged

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        self._agrees[key] = 0

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None:
        n = self._agrees.get(key, -1)
        if n < 0:
            return
        future = self.futures.get(key, [])
        self._agrees[key] = n + len(new_tokens) if list(new_tokens) == future[n:n + len(new_tokens)] else -1

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        if self._agrees.get(key, -1) != len(output):
            return NO_DRAFT
        if self.max_spec_tokens is not None:
            budget = min(budget, self.max_spec_tokens)
        return Draft(self.futures.get(key, [])[len(output):len(output) + budget])


NO_TOKEN = -(1 << 31)  # "no transition" in the first-transition slot (token ids lie in [-2**31 + 1, 2**31))


class SuffixAutomaton:
    """Generalised suffix automaton of several int token texts, each grown online, interleaved.

    Every substring of the texts is a path from the root, so the longest prefix of a sequence that
    occurs anywhere in them is a walk from the root (``longest_prefix``). Unlike a depth-limited
    suffix trie (O(tokens x depth) nodes) it has at most 2n - 1 states and 3n - 4 transitions for
    n tokens, whatever the match lengths: a 2,000-token text gives at most 3,999 states where a
    trie of depth 2,000 has about two million nodes. Texts are extended in any interleaving
    (``extend(text_id, tokens)``), as the in-flight rollouts of a batch grow; nothing is removed.

    Storage: four int32 arrays per state (length, suffix link, first transition's token and
    target) and a dict only for states with a second transition, so a state costs about 16 bytes
    plus 100 bytes per extra transition (``approx_bytes``).

    Example: texts [1, 2, 3] and [2, 3, 4]; ``longest_prefix([2, 3, 4, 5], 0, 10)`` is 3
    ([2, 3, 4] occurs in the second text), ``longest_prefix([3, 1], 0, 10)`` is 1.
    """

    def __init__(self):
        self._len = array("i", [0])
        self._link = array("i", [-1])
        self._tok = array("i", [NO_TOKEN])
        self._to = array("i", [-1])
        self._more: dict[int, dict[int, int]] = {}  # state -> {token: target}, second transition on
        self._last: dict[int, int] = {}  # text id -> the state of that whole text
        self.num_tokens = 0

    @property
    def num_states(self) -> int:
        return len(self._len)

    @property
    def num_transitions(self) -> int:
        return sum(t != NO_TOKEN for t in self._tok) + sum(len(d) for d in self._more.values())

    def approx_bytes(self) -> int:
        extra = sum(len(d) for d in self._more.values())
        return 16 * len(self._len) + 100 * extra + 64 * len(self._more)

    def next_state(self, state: int, token: int) -> int:
        """The transition of ``state`` on ``token``, or -1."""
        if self._tok[state] == token:
            return self._to[state]
        more = self._more.get(state)
        return -1 if more is None else more.get(token, -1)

    def longest_prefix(self, seq: Sequence[int], start: int, limit: int) -> int:
        """Largest m <= limit with seq[start:start + m] a substring of some text."""
        tok, to, more = self._tok, self._to, self._more
        end = min(len(seq), start + limit)
        state, i = 0, start
        while i < end:
            c = seq[i]
            if tok[state] == c:
                state = to[state]
            else:
                d = more.get(state)
                if d is None:
                    break
                state = d.get(c, -1)
                if state < 0:
                    break
            i += 1
        return i - start

    def extend(self, text_id: int, tokens: Sequence[int]) -> None:
        """Append tokens to text ``text_id`` (a new text starts empty); amortised O(1) per token."""
        length, link, tok, to, more = self._len, self._link, self._tok, self._to, self._more

        def get(p: int, c: int) -> int:
            if tok[p] == c:
                return to[p]
            d = more.get(p)
            return -1 if d is None else d.get(c, -1)

        def put(p: int, c: int, q: int) -> None:
            if tok[p] == c or tok[p] == NO_TOKEN:
                tok[p], to[p] = c, q
            else:
                d = more.get(p)
                if d is None:
                    d = more[p] = {}
                d[c] = q

        def clone(q: int, n: int) -> int:
            k = len(length)
            length.append(n)
            link.append(link[q])
            tok.append(tok[q])
            to.append(to[q])
            d = more.get(q)
            if d is not None:
                more[k] = dict(d)
            return k

        last = self._last.get(text_id, 0)
        for c in tokens:
            q = get(last, c)
            if q >= 0:  # the extended text already occurs: reuse (or split off) its state
                if length[q] == length[last] + 1:
                    last = q
                    continue
                k = clone(q, length[last] + 1)
                link[q] = k
                p = last
                while p >= 0 and get(p, c) == q:
                    put(p, c, k)
                    p = link[p]
                last = k
                continue
            cur = len(length)
            length.append(length[last] + 1)
            link.append(0)
            tok.append(NO_TOKEN)
            to.append(-1)
            p = last
            while p >= 0:
                q = get(p, c)
                if q >= 0:
                    break
                put(p, c, cur)
                p = link[p]
            if p >= 0:
                if length[q] == length[p] + 1:
                    link[cur] = q
                else:
                    k = clone(q, length[p] + 1)
                    while p >= 0 and get(p, c) == q:
                        put(p, c, k)
                        p = link[p]
                    link[q] = link[cur] = k
            last = cur
        self._last[text_id] = last
        self.num_tokens += len(tokens)
