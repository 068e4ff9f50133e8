"""The learned drafter: a draft model (``bench.drafters.draft_lm``) driven as a method, warmed up on
the run's earlier rollouts, updated between steps, and watched for the stale-drafter fault.

Schedule, in steps of the trace:

- **warm-up**: before the first step it drafts, ``warmup_steps`` optimizer steps on the rollouts
  of the last ``history_steps`` steps before it (``lag`` more steps held back);
- **updates**: before each later step it drafts, once ``update_every`` steps have passed since the
  last training (0: never, a frozen drafter), ``update_steps`` optimizer steps on the same window
  of recent rollouts, so the drafter follows the policy.

Steps it is only shown as history (a sparse trace's rollouts-only steps, ``begin_history_step``)
train nothing: in a dense replay it trains between every two steps, in a sparse one before the
steps it drafts.

Training runs in ``begin_step``, between rollout calls: its seconds are reported on their own
(``train_s``), never inside a step's rollout seconds, as a trainer would run it on idle GPUs.

**The stale-drafter guard.** After a weight sync a drafter that was not reloaded, or whose weights
were broken, drafts for a policy it no longer matches and its acceptance collapses while training
looks normal (vLLM #52487, miles #1926, SGLang #27718). Each step's acceptance (accepted over
verified draft tokens) is compared with the median of the drafter's last ``guard_steps`` steps:
below ``collapse_ratio`` of it, the step's ``stale`` stat is 1, and the run's table flags it.
"""
from __future__ import annotations

import random
import statistics
from typing import Sequence

from methods.base import Draft, NO_DRAFT, NullDrafter, Rollout, RolloutKey


class DraftLMDrafter(NullDrafter):
    """A small draft LM over tokens (``bench.drafters.draft_lm.DraftLM``), trained on the run's rollouts."""

    name = "draft_lm"
    drafts = "decoding"

    def __init__(self, max_spec_tokens: int = 6, window: int = 32, layers: int = 2, hidden: int = 128,
                 heads: int = 4, draft_vocab: int = 0, lr: float = 3e-3, batch_windows: int = 32,
                 warmup_steps: int = 300, update_every: int = 1, update_steps: int = 20, history_steps: int = 4,
                 lag: int = 0, guard_steps: int = 4, collapse_ratio: float = 0.5, seed: int = 0):
        self.max_spec_tokens, self.window, self.layers, self.hidden, self.heads = max_spec_tokens, window, layers, hidden, heads
        self.draft_vocab, self.lr, self.batch_windows, self.seed = draft_vocab, lr, batch_windows, seed
        self.warmup_steps, self.update_every, self.update_steps = warmup_steps, update_every, update_steps
        self.history_steps, self.lag, self.guard_steps, self.collapse_ratio = history_steps, lag, guard_steps, collapse_ratio
        self.lm = None  # built at warm-up, once the vocabulary is known
        self._rng = random.Random(seed)
        self._step = -1
        self._last_update: int | None = None
        self._by_step: dict[int, list[tuple[list[int], list[int]]]] = {}
        self._prompts: dict[RolloutKey, list[int]] = {}
        self._outputs: dict[RolloutKey, list[int]] = {}
        self._ready: dict[RolloutKey, Draft] = {}
        self._proposed: dict[RolloutKey, Draft] = {}
        self._rates: list[float] = []  # acceptance of each earlier step that drafted
        self._trained, self._train_read = _no_training(), False
        self.reset_stats()

    # ----- the step boundary: training -----
    def begin_history_step(self, step: int) -> None:
        """A step shown as finished rollouts only: recorded for training, nothing trained."""
        self._close_step()
        self._step = step

    def begin_step(self, step: int) -> None:
        self._close_step()
        self._step = step
        window = [s for s in sorted(self._by_step) if s < step - self.lag][-self.history_steps:]
        data = [pair for s in window for pair in self._by_step[s]]
        if not data:
            return
        if self.lm is None:
            self._build(data)
            self._train(data, self.warmup_steps, "warmup")
        elif self.update_every and step - self._last_update >= self.update_every:
            self._train(data, self.update_steps, "update")
        else:
            return
        self._last_update = step

    def _build(self, data) -> None:
        """The draft model over the warm-up data's tokens (its ``draft_vocab`` most frequent, 0: all)."""
        from collections import Counter

        from bench.drafters.draft_lm import DraftLM
        counts = Counter(t for p, r in data for t in p + r)
        tokens = [t for t, _ in counts.most_common(self.draft_vocab or None)]
        self.lm = DraftLM(tokens, self.layers, self.hidden, self.heads, self.window, self.lr, self.seed)

    def _train(self, data, steps: int, kind: str) -> None:
        """Train and count it (``stats`` reports the training since the table last read it)."""
        out = self.lm.train(data, steps, self.batch_windows, self._rng)
        self._trained["train_s"] += out["seconds"]
        self._trained["train_tokens"] += out["tokens"]
        self._trained[f"{kind}s"] += 1
        self._trained["train_loss"] = out["loss"]

    def inject_fault(self, kind: str) -> None:
        """A weight-sync fault, for the guard's test: ``corrupt`` (noise in every weight) or ``reset``
        (the untrained initial weights: a serving copy the trained weights never reached)."""
        if kind == "corrupt":
            self.lm.corrupt(self.seed + 1)
        elif kind == "reset":
            self.lm.reset()
        else:
            raise ValueError(f"inject_fault({kind!r}): known faults are 'corrupt' and 'reset'")

    # ----- a rollout's life: record its tokens, draft for it -----
    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        self._prompts[key], self._outputs[key] = list(prompt), []

    def begin_iteration(self, live, budget: int | None = None) -> None:
        """Draft every live row in one batched call of the draft model."""
        self._ready = {}
        k = self.max_spec_tokens if budget is None else min(budget, self.max_spec_tokens)
        if self.lm is None or k <= 0 or not live:
            return
        keys = [key for key, _ in live]
        chains = self.lm.propose([self._prompts.get(key, []) + self._outputs.get(key, []) for key in keys], k)
        self._ready = {key: Draft(t, None, lp) for key, (t, lp) in zip(keys, chains)}

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        d = self._ready.pop(key, None)
        if d is None:  # asked outside an iteration (a first draft, a probe): one row alone
            if self.lm is None:
                return NO_DRAFT
            self._outputs[key] = list(output)
            self.begin_iteration([(key, len(output))])
            d = self._ready.pop(key, NO_DRAFT)
        d = d.truncated(budget)
        self._proposed[key] = d
        return d

    def take_model_passes(self) -> dict | None:
        """The draft model's passes since the last take (``bench.drafters.model_passes``); None before it is built."""
        return None if self.lm is None else self.lm.passes.take()

    def discard(self, key: RolloutKey) -> None:
        """The last proposal for ``key`` was not used (a composite drafted instead): not counted."""
        self._proposed.pop(key, None)

    def verified(self, key: RolloutKey, draft_len: int) -> None:
        if key in self._proposed:
            self._proposed[key] = self._proposed[key].truncated(draft_len)

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None:
        d = self._proposed.pop(key, None)
        if d is not None and len(d):
            accepted = 0
            for a, b in zip(d.token_ids, new_tokens):
                if a != b:
                    break
                accepted += 1
            self._stats["draft_tokens"] += len(d)
            self._stats["accepted_tokens"] += min(accepted, len(d))
        self._outputs.setdefault(key, []).extend(new_tokens)

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        self._by_step.setdefault(self._step, []).append((list(rollout.prompt_token_ids), list(rollout.token_ids)))
        self._prompts.pop(key, None)
        self._outputs.pop(key, None)
        keep = sorted(self._by_step)[-(self.history_steps + self.lag + 1):]
        self._by_step = {s: self._by_step[s] for s in keep}

    # ----- what the table reads -----
    def _close_step(self) -> None:
        """Between steps: the last step's acceptance joins the guard's history; training counts
        restart once the table has read them."""
        if self._train_read:
            self._trained, self._train_read = _no_training(), False
        s = self._stats
        if s["draft_tokens"]:
            self._rates.append(s["accepted_tokens"] / s["draft_tokens"])
            self._stats["draft_tokens"] = self._stats["accepted_tokens"] = 0

    def reset_stats(self) -> None:
        self._stats = {"draft_tokens": 0, "accepted_tokens": 0}

    def stats(self) -> dict:
        s = {**self._trained, **self._stats}
        self._train_read = True
        rate = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else float("nan")
        recent = self._rates[-self.guard_steps:]
        stale = bool(recent) and s["draft_tokens"] > 0 and rate < self.collapse_ratio * statistics.median(recent)
        s.update(acceptance=rate, stale=int(stale), parameters=self.lm.num_parameters if self.lm else 0,
                 draft_vocab=len(self.lm.d2t) - 1 if self.lm else 0)
        return s


def _no_training() -> dict:
    return {"train_s": 0.0, "train_tokens": 0, "warmups": 0, "updates": 0, "train_loss": float("nan")}
