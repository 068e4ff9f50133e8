"""What every generation loop does around a drafter, written once: report the live batch, ask for a
draft that fits the remaining length, and count drafts and accepted tokens the way vLLM's
spec-decode counters do.

Used by the torch reference engine and the model-free simulator, so their counters agree by
construction (``pytest tests/test_simulate.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from methods.base import Draft, Drafter, RolloutKey


def report_live(drafter: Drafter, live: Sequence[tuple[RolloutKey, int]]) -> None:
    """Tell the drafter the live batch of this iteration, [(key, output length), ...] in batch
    order, before any of its proposals (the optional ``begin_iteration`` hook, methods/base.py)."""
    hook = getattr(drafter, "begin_iteration", None)
    if hook is not None:
        hook(live)


def next_draft(drafter: Drafter, key: RolloutKey, output: Sequence[int], max_new_tokens: int) -> Draft:
    """The drafter's proposal cut to what can still be emitted: budget = remaining - 1, since a
    fully accepted draft is followed by one more sampled token (the bonus)."""
    budget = max_new_tokens - len(output) - 1
    if budget <= 0:
        return Draft()
    draft = drafter.propose(key, output, budget).truncated(budget)
    if draft.parents is not None:
        draft.validate()
    return draft


@dataclass
class DraftCounters:
    """Per-rollout counters (DESIGN.md section 5; names as vLLM's)."""

    num_forward_passes: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, draft_len: int, accepted: int) -> None:
        """One verification of a draft of ``draft_len`` tokens, ``accepted`` of them emitted."""
        self.num_forward_passes += 1
        if not draft_len:
            return
        self.num_drafts += 1
        self.num_draft_tokens += draft_len
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < accepted:
            per_pos.extend([0] * (accepted - len(per_pos)))
        for i in range(accepted):
            per_pos[i] += 1

    def as_dict(self) -> dict:
        return {"num_forward_passes": self.num_forward_passes, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}
