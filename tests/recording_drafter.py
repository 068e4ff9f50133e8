"""A drafter wrapper that logs every call it gets, to compare the call order of two engines."""
from __future__ import annotations


def recording(cls):
    """``cls`` with every drafter call logged in ``calls`` (what it was told, in order)."""

    class Recording(cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.calls = []

        def begin_step(self, step):
            self.calls.append(("begin_step", step))
            super().begin_step(step)

        def start(self, key, prompt):
            self.calls.append(("start", key, tuple(prompt)))
            super().start(key, prompt)

        def begin_iteration(self, live, budget=None):
            self.calls.append(("begin_iteration", tuple(live), budget))
            super().begin_iteration(live, budget=budget)

        def propose(self, key, output, budget):
            draft = super().propose(key, output, budget)
            self.calls.append(("propose", key, len(output), budget, tuple(draft.token_ids)))
            return draft

        def verified(self, key, draft_len):
            self.calls.append(("verified", key, draft_len))
            super().verified(key, draft_len)

        def observe(self, key, new_tokens):
            self.calls.append(("observe", key, tuple(new_tokens)))
            super().observe(key, new_tokens)

        def finish(self, key, rollout):
            self.calls.append(("finish", key, tuple(rollout.token_ids), rollout.finish_reason))
            super().finish(key, rollout)

    return Recording
