"""The tree drafters' index compiled: ``SuffixIndex`` (``methods/suffix/index.py``) with its automaton and queries in C.

    python -m pytest tests/test_suffix_index.py -q      # both indexes against the reference trie

The simulator spends most of a tree drafter's time in the pure-Python automaton (about 4 us a
token to insert) and its drafting walks; ``methods/suffix/_compiled.c`` holds the same states,
counts, creation times and top children in C arrays it owns, and answers every query of
``SuffixIndex`` by the same rule with the same float operations in the same order: drafts,
scores and ties equal the Python index's to the bit (the tests check it call by call). The
Python modules stay the reference (their docstrings say why each step is right).

The extension is built by ``pip install -e .`` where a C compiler is at hand (``setup.py``; it is
optional: without a compiler the install goes on and ``compiled_available()`` is false). The
tree drafters' ``backend: auto`` runs on it where it imports (``methods/suffix/tree.py``).
"""
from __future__ import annotations

from typing import Sequence

from methods.suffix.speculation import Speculation

try:
    from methods.suffix._compiled import CompiledAutomaton, extend_many, speculate_own_many, speculate_pair_many
except ImportError as exc:  # no compiler at install time: the pure-Python index runs instead
    CompiledAutomaton = extend_many = speculate_own_many = speculate_pair_many = None
    if "cannot import name" in str(exc):  # the module loads: a build older than this code
        import warnings
        warnings.warn(f"methods.suffix._compiled is an older build ({exc}); the tree drafters run in Python "
                      f"until it is rebuilt: pip install -e . (or python setup.py build_ext --inplace)")


def compiled_available() -> bool:
    return CompiledAutomaton is not None


if CompiledAutomaton is not None:
    class CompiledIndex(CompiledAutomaton):
        """``SuffixIndex`` with the same interface, drafts and pickles (node ids are state ids),
        plus ``speculate_own``: a sequence's own matches and a rule in one call. Token ids must
        fit in a signed 32-bit int."""

        def __reduce__(self):
            return (CompiledIndex, (self.max_depth, self.compact_ratio), self.__getstate__())

        def match(self, context: Sequence[int]) -> list[int]:
            n = len(context)
            return self._chain(*self._longest_live(context, max(0, n - self.max_depth), n))

        def context_matches(self, seq_id: int, context: Sequence[int]) -> list[int]:
            if seq_id not in self or self.sequence_length(seq_id) < min(len(context), self.max_depth):
                return self.match(context)
            return self.own_matches(seq_id)

        def matcher(self, tokens: Sequence[int] = ()) -> "CompiledMatcher":
            return CompiledMatcher(self, tokens)

        def speculate(self, matches: Sequence[int], max_spec_tokens: int, factor: float = 1.0,
                      offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
            return Speculation(*self._speculate(matches, False, max_spec_tokens, factor, offset, min_prob, tree))

        def speculate_longest(self, matches: Sequence[int], max_spec_tokens: int, factor: float = 1.0,
                              offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
            return Speculation(*self._speculate(matches, True, max_spec_tokens, factor, offset, min_prob, tree))

        def speculate_own(self, seq_id: int, longest: bool, max_spec_tokens: int, factor: float = 1.0,
                          offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
            """``speculate_longest`` (or ``speculate``) of ``own_matches(seq_id)``, in one call."""
            return Speculation(*self._speculate_own(seq_id, longest, max_spec_tokens, factor, offset, min_prob, tree))

        def speculate_first_hit(self, context: Sequence[int], window: int, min_match: int,
                                max_spec_tokens: int, min_prob: float) -> Speculation:
            return Speculation(*self._first_hit(context, window, min_match, max_spec_tokens, min_prob))

    class CompiledMatcher:
        """``IndexMatcher`` on a ``CompiledIndex``: the suffix matches of a growing context that is
        not in the index (one automaton step a token; rematched once after the index changed)."""

        __slots__ = ("index", "tokens", "state", "n", "version")

        def __init__(self, index: CompiledIndex, tokens: Sequence[int] = ()):
            self.index = index
            self.tokens: list[int] = list(tokens)[-index.max_depth:]
            self._rematch()

        def _rematch(self) -> None:
            n = len(self.tokens)
            self.state, self.n = self.index._longest_live(self.tokens, max(0, n - self.index.max_depth), n)
            self.version = self.index.version

        def feed(self, tokens: Sequence[int]) -> None:
            depth = self.index.max_depth
            self.tokens.extend(tokens)
            if len(self.tokens) > 2 * depth:
                del self.tokens[:-depth]
            if self.version == self.index.version:  # else rematched lazily in matches()
                self.state, self.n = self.index._feed(self.state, self.n, tokens)

        def matches(self) -> list[int]:
            if self.version != self.index.version:
                self._rematch()
            return self.index._chain(self.state, self.n)
else:
    CompiledIndex = CompiledMatcher = None
