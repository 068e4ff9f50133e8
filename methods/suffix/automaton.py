"""The counted suffix automaton under the tree drafters' pure-Python index: construction (append, copy, remove, compact), linear in the text.

    python -m pytest tests/test_suffix_index.py -q

``CountedSuffixAutomaton`` holds the state of ``SuffixIndex`` (``methods/suffix/index.py``, which adds
matching and drafting): a generalised suffix automaton of the inserted sequences, at most two
states per token, whatever the depth, with the counts a depth-``max_depth`` suffix trie would
hold. An append costs the automaton's amortised O(1) plus one step per *distinct* occurrence class
among the last ``max_depth`` suffixes (usually a handful, at most ``max_depth``).

Why it is the same trie. All substrings of one automaton state have the same end positions, so
the same count (occurrences) and the same continuations, with the same counts: a state stands
for several trie nodes at once (its lengths ``len(link) + 1 .. len``), and the trie's node of a
string u of length m <= max_depth is (state of u, m). The depth limit is the depth m: a node at
depth ``max_depth`` has no children. Counts are kept live for the states that hold a string of
length <= ``max_depth`` only (the others never answer a query): appending token c to a sequence
walks the states of its previous suffixes of length 0 .. max_depth - 1 (the trie's active nodes,
grouped by state), and for each such parent p the child ``next(p, c)`` gains one occurrence and
may become p's top child. Removing a sequence walks the same pairs (stored per position) with
-1; its text stays in the automaton with count 0, so removed texts still cost memory (until
``compact``, below) but never match or draft.

Tie order. The trie ranks a node's children by count, ties to the child created first; a node is
created when its count goes from 0 to 1 (at its first occurrence, or again after every
occurrence was removed), and within one appended token shallower nodes are created first. Here
each state records the time (appended-token counter) at which its count last went from 0 to 1,
and ties between children go to the earlier time, then to the shallower node (tree drafts): the
trie's order exactly. ``compact`` rebuilds the automaton from the live sequences alone, their
tokens re-inserted in their original time order; afterwards a string's time is its first *live*
occurrence, where the trie keeps the time of an occurrence that has since been removed (if its
count never reached 0 meanwhile): only equal-count ties can then break differently, and only after
a compaction, which runs when removed tokens outnumber the live ones (``compact_ratio``).
"""
from __future__ import annotations

from array import array
from typing import Sequence

from methods.suffix.speculation import START

NO_TOKEN = -(1 << 31)  # "no transition" in a state's first-transition slot
UNKNOWN = -2  # top child not known (a child lost occurrences): ranked again when asked
NO_MORE: dict[int, int] = {}  # the transitions of a state that has no second one


class CountedSuffixAutomaton:
    """Counted generalised suffix automaton of several sequences, its counts kept as a
    depth-``max_depth`` suffix trie would keep them; ``SuffixIndex`` queries it. Token ids must
    fit in a signed 32-bit int."""

    def __init__(self, max_depth: int = 64, compact_ratio: float = 2.0):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.compact_ratio = compact_ratio
        self._reset()
        self.version = 0

    def _reset(self) -> None:
        self._len = [0]
        self._link = [-1]
        self._tok = [NO_TOKEN]  # first transition: token and target
        self._to = [-1]
        self._more: dict[int, dict[int, int]] = {}  # state -> {token: target}, second transition on
        self._count = [0]  # live occurrences (kept for states with a string <= max_depth)
        self._time = array("q", [0])  # when the count last went 0 -> 1
        self._top = [UNKNOWN]  # live child of the highest count; -1 none, UNKNOWN: rank again (the root: always)
        self._last_tok = array("i", [START])  # the token every string of the state ends with
        self._clock = 0
        self._seqs: dict[int, list[int]] = {}
        self._end: dict[int, int] = {}  # seq -> state of the whole sequence (the automaton's "last")
        self._deep: dict[int, int] = {}  # seq -> a state holding its suffix of length min(len, max_depth)
        self._par: dict[int, array] = {}  # seq -> per position: state of the suffix before it (parent)
        self._when: dict[int, array] = {}  # seq -> per position: the clock when it was appended
        self._dead_tokens = 0

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

    @property
    def num_nodes(self) -> int:
        """Automaton states (not comparable with the trie's nodes: each stands for several)."""
        return len(self._len)

    def approx_bytes(self) -> int:
        extra = sum(len(d) for d in self._more.values())
        live = sum(len(s) for s in self._seqs.values())
        return 40 * len(self._len) + 100 * extra + 64 * len(self._more) + 20 * live

    def count_of(self, node: int) -> int:
        return self._count[node]

    def top_child(self, node: int) -> int | None:
        top = self._top_of(node)
        return None if top < 0 else top

    def children(self, node: int) -> dict[int, int]:
        """{token: child state} of the live continuations (whatever the depth)."""
        out = {}
        if self._tok[node] != NO_TOKEN and self._count[self._to[node]] > 0:
            out[self._tok[node]] = self._to[node]
        for token, child in self._more.get(node, {}).items():
            if self._count[child] > 0:
                out[token] = child
        return dict(sorted(out.items(), key=lambda kv: self._time[kv[1]]))

    # ----- ranking -----
    def _top_of(self, node: int) -> int:
        """The live child of the highest count (-1: none), ranked again where it is ``UNKNOWN``."""
        top = self._top[node]
        if top != UNKNOWN:
            return top
        count, when = self._count, self._time
        best = -1
        kids = [self._to[node]] if self._tok[node] != NO_TOKEN else []
        d = self._more.get(node)
        if d is not None:
            kids += d.values()
        for child in kids:
            c = count[child]
            if c > 0 and (best < 0 or c > count[best] or (c == count[best] and when[child] < when[best])):
                best = child
        if node:  # the root's is never kept (appends do not rank it)
            self._top[node] = best
        return best

    # ----- building -----
    def append(self, seq_id: int, token: int) -> None:
        self.extend(seq_id, (token,))

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append tokens to a sequence (new or existing)."""
        if not tokens:
            return
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = []
            self._end[seq_id] = 0
            self._deep[seq_id] = 0
            self._par[seq_id] = array("i")
            self._when[seq_id] = array("q")
        self._insert(seq_id, tokens)
        self.version += 1

    def _insert(self, seq_id: int, tokens: Sequence[int], clock: Sequence[int] | None = None) -> None:
        length, link, tok, to, more = self._len, self._link, self._tok, self._to, self._more
        count, when_, top, last_tok = self._count, self._time, self._top, self._last_tok
        seq, par, when = self._seqs[seq_id], self._par[seq_id], self._when[seq_id]
        last, deep = self._end[seq_id], self._deep[seq_id]
        top_depth = self.max_depth - 1
        n = len(seq)
        t = self._clock
        for i, c in enumerate(tokens):
            # ---- the automaton (generalised, online); a clone takes over q's counts and ranks
            if tok[last] == c:
                q = to[last]
            else:
                q = more.get(last, NO_MORE).get(c, -1)
            if q >= 0 and length[q] == length[last] + 1:
                last = q
            else:
                if q >= 0:  # the extended text occurs already, but q also holds longer strings
                    p, cur = last, -1
                else:
                    cur = len(length)
                    length.append(length[last] + 1)
                    link.append(0)
                    tok.append(NO_TOKEN)
                    to.append(-1)
                    count.append(0)
                    when_.append(0)
                    top.append(-1)
                    last_tok.append(c)
                    p = last
                    while p >= 0:
                        if tok[p] == c:
                            q = to[p]
                            break
                        d = more.get(p)
                        if d is not None:
                            q = d.get(c, -1)
                            if q >= 0:
                                break
                        if tok[p] == NO_TOKEN:
                            tok[p], to[p] = c, cur
                        elif d is None:
                            more[p] = {c: cur}
                        else:
                            d[c] = cur
                        p = link[p]
                    if p < 0:
                        last = cur
                        q = -1
                    elif length[q] == length[p] + 1:
                        link[cur] = q
                        last = cur
                        q = -1
                if q >= 0:  # split q: the clone k holds its strings of length <= length[p] + 1
                    k = len(length)
                    length.append(length[p] + 1)
                    link.append(link[q])
                    tok.append(tok[q])
                    to.append(to[q])
                    count.append(count[q])
                    when_.append(when_[q])
                    top.append(top[q])
                    last_tok.append(last_tok[q])
                    d = more.get(q)
                    if d is not None:
                        more[k] = d.copy()
                    while p >= 0:  # p and its suffix links that go to q on c go to k
                        if tok[p] == c:
                            if to[p] != q:
                                break
                            to[p] = k
                        else:
                            d = more.get(p)
                            if d is None or d.get(c) != q:
                                break
                            d[c] = k
                        if top[p] == q:
                            top[p] = k
                        p = link[p]
                    link[q] = k
                    if cur >= 0:
                        link[cur] = k
                        last = cur
                    else:
                        last = k
            # ---- counts: the parents are the suffixes of length 0 .. max_depth - 1 before c
            want = n if n < top_depth else top_depth
            s = deep
            while True:
                k = link[s]
                if k < 0 or length[k] < want:
                    break
                s = k
            par.append(s)
            if clock is not None:
                t = clock[i]
            when.append(t)
            p, prev = s, -1
            cx = 0
            while p > 0:  # the root (a parent too) is done below: its top child is never asked
                if tok[p] == c:
                    x = to[p]
                else:
                    x = more[p][c]
                if x != prev:
                    cx = count[x] + 1
                    count[x] = cx
                    if cx == 1:
                        when_[x] = t
                    if prev < 0:
                        deep = x
                    prev = x
                tp = top[p]
                if tp != x:
                    if tp == -1:
                        top[p] = x
                    elif tp >= 0:
                        ct = count[tp]
                        if cx > ct or (cx == ct and when_[x] < when_[tp]):
                            top[p] = x
                p = link[p]
            x = to[0] if tok[0] == c else more[0][c]
            if x != prev:
                cx = count[x] + 1
                count[x] = cx
                if cx == 1:
                    when_[x] = t
                if prev < 0:
                    deep = x
            t += 1
            n += 1
        count[0] += len(tokens)
        seq += tokens
        self._clock = t
        self._end[seq_id], self._deep[seq_id] = last, deep

    def extend_copy(self, seq_id: int, source_id: int) -> None:
        """A new sequence ``seq_id`` equal to the live sequence ``source_id`` (DAS's recency
        copies): the same as ``extend(seq_id, sequence(source_id))``, without touching the
        automaton (the copy's positions are the source's, counted once more)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} exists")
        src = self._seqs[source_id]
        self._seqs[seq_id] = list(src)
        self._end[seq_id], self._deep[seq_id] = self._end[source_id], self._deep[source_id]
        par = self._par[seq_id] = array("i", self._par[source_id])
        t = self._clock
        self._when[seq_id] = array("q", range(t, t + len(src)))
        self._clock = t + len(src)
        length, link, tok, to, more = self._len, self._link, self._tok, self._to, self._more
        count, when_, top = self._count, self._time, self._top
        top_depth = self.max_depth - 1
        for i, c in enumerate(src):
            want = i if i < top_depth else top_depth
            p = par[i]
            while True:
                k = link[p]
                if k < 0 or length[k] < want:
                    break
                p = k
            prev, cx = -1, 0
            while p >= 0:
                x = to[p] if tok[p] == c else more[p][c]
                if x != prev:
                    cx = count[x] + 1
                    count[x] = cx
                    if cx == 1:
                        when_[x] = t + i
                    prev = x
                tp = top[p]
                if tp != x:
                    if tp == -1:
                        top[p] = x
                    elif tp >= 0:
                        ct = count[tp]
                        if cx > ct or (cx == ct and when_[x] < when_[tp]):
                            top[p] = x
                p = link[p]
        count[0] += len(src)
        self.version += 1

    def remove(self, seq_id: int) -> None:
        """Forget a sequence: every count it added goes back down (its text stays, dead)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        par = self._par.pop(seq_id)
        del self._end[seq_id], self._deep[seq_id], self._when[seq_id]
        length, link, tok, to, more = self._len, self._link, self._tok, self._to, self._more
        count, top = self._count, self._top
        top_depth = self.max_depth - 1
        for i, c in enumerate(seq):
            want = i if i < top_depth else top_depth
            p = par[i]
            while True:
                k = link[p]
                if k < 0 or length[k] < want:
                    break
                p = k
            prev = -1
            while p >= 0:
                x = to[p] if tok[p] == c else more[p][c]
                if x != prev:
                    count[x] -= 1
                    prev = x
                if top[p] == x:
                    top[p] = UNKNOWN
                p = link[p]
            count[0] -= 1
        self._dead_tokens += len(seq)
        self.version += 1
        live = count[0]
        if self._dead_tokens > self.compact_ratio * live + 4096:
            self.compact()

    def compact(self) -> None:
        """Rebuild from the live sequences, their tokens re-inserted in their original time order
        (the order of every extend since the index was made), so drafts stay the same up to
        equal-count ties (module docstring)."""
        seqs, whens = self._seqs, self._when
        clock, version = self._clock, self.version
        events = sorted(((when[i], sid, i) for sid, when in whens.items() for i in range(len(when))))
        self._reset()
        for sid in seqs:  # keep the sequences' order (and ids)
            self._seqs[sid] = []
            self._end[sid] = self._deep[sid] = 0
            self._par[sid] = array("i")
            self._when[sid] = array("q")
        for t, sid, i in events:
            self._insert(sid, (seqs[sid][i],), (t,))
        self._clock, self.version = clock, version + 1  # state ids changed: matchers rematch
