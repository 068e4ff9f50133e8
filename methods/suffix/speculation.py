"""What a suffix structure drafts: a chain or tree of tokens with its SuffixDecoding score. Its own
module so every structure (trie, automaton, native tree) returns the same type without importing
another structure."""
from __future__ import annotations

from typing import NamedTuple

from methods.base import NO_DRAFT, Draft

START = -1  # token id that marks the start of a response in per-prompt tries (never drafted)


class Speculation(NamedTuple):
    """A drafted chain or tree with its SuffixDecoding score (sum of path probabilities)."""

    token_ids: list[int]
    parents: list[int] | None
    score: float
    match_len: int

    def draft(self) -> Draft:
        return Draft(self.token_ids, self.parents) if self.token_ids else NO_DRAFT


NO_SPECULATION = Speculation([], None, 0.0, 0)
