"""The EAGLE-style drafter: a head over the policy's hidden states (``bench.drafters.eagle_head``),
driven as a method on the learned drafter's schedule (``bench.drafters.learned``: warm-up, updates
between steps, the stale-drafter guard, injected faults).

It reads what only the engine has: the policy's model (``attach_policy``, called by the replay
before every step with the checkpoint of that step, as a weight sync would) and the hidden state
behind every token the policy emits (``observe_features``, which the scheduler calls before
``observe`` when a drafter declares ``reads_features``; torch_ref hands them over, the simulator
and the vLLM/SGLang adapters cannot and refuse the method with the reason).

Training data, as TLT collects it: the features of the rollouts this drafter saw generated
(collected for free while they ran, under the checkpoint of their step) and, for rollouts it was
only shown as history (a sparse trace's rollouts-only steps, the warm-up's), features the policy
computes here over up to ``feature_rollouts`` of them a training round (the current checkpoint's,
one forward pass each; its seconds count as training seconds).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from methods.base import Draft, Rollout, RolloutKey

from bench.drafters.learned import DraftLMDrafter


@dataclass
class TrainingRollout:
    """One rollout as training data: its tokens and, once known, the feature behind each."""

    prompt: list[int]
    tokens: list[int]
    feats: Any = None  # torch.Tensor [len(tokens), H] or None (not computed yet)


class EagleDrafter(DraftLMDrafter):
    """EAGLE-1-style chain drafts from a one-layer head over the policy's features."""

    name = "eagle"
    drafts = "decoding"
    reads_features = True

    def __init__(self, max_spec_tokens: int = 6, window: int = 32, draft_vocab: int = 0, lr: float = 3e-3,
                 batch_windows: int = 32, warmup_steps: int = 300, update_every: int = 1, update_steps: int = 20,
                 history_steps: int = 4, lag: int = 0, feature_rollouts: int = 64, guard_steps: int = 4,
                 collapse_ratio: float = 0.5, seed: int = 0):
        super().__init__(max_spec_tokens=max_spec_tokens, window=window, draft_vocab=draft_vocab, lr=lr,
                         batch_windows=batch_windows, warmup_steps=warmup_steps, update_every=update_every,
                         update_steps=update_steps, history_steps=history_steps, lag=lag, guard_steps=guard_steps,
                         collapse_ratio=collapse_ratio, seed=seed)
        self.feature_rollouts = feature_rollouts
        self._policy = None
        self._feats: dict[RolloutKey, list] = {}  # per live row: the features behind its emitted tokens
        self._collect: set[RolloutKey] = set()  # rows whose every feature is kept, to train on

    # ----- the policy, from the engine -----
    def attach_policy(self, policy) -> None:
        """The policy's model for this step (a weight sync): its features, embedding and output layer."""
        self._policy = policy
        if self.lm is not None:
            self.lm.attach(policy)

    @property
    def attached_policy(self) -> Any:
        """The policy attached for this step (None before the engine attached one)."""
        return self._policy

    def _need_policy(self) -> Any:
        if self._policy is None:
            raise RuntimeError("eagle drafts from the policy's hidden states: its engine must call "
                               "attach_policy(model) before begin_step (torch_ref does; run it there)")
        return self._policy

    def _build(self, data: list[TrainingRollout]) -> None:
        from collections import Counter

        from bench.drafters.eagle_head import EagleHead
        counts = Counter(t for s in data for t in s.tokens)
        tokens = [t for t, _ in counts.most_common(self.draft_vocab or None)]
        self.lm = EagleHead(self._need_policy(), tokens, self.window, self.lr, self.seed)

    def _train(self, data: list[TrainingRollout], steps: int, kind: str) -> None:
        t0 = time.perf_counter()
        self._fill_features(data)
        feature_s = time.perf_counter() - t0
        out = self.lm.train([(s.feats, s.tokens) for s in data if s.feats is not None], steps,
                            self.batch_windows, self._rng)
        self._trained["train_s"] += out["seconds"] + feature_s
        self._trained["feature_s"] = self._trained.get("feature_s", 0.0) + feature_s
        self._trained["train_tokens"] += out["tokens"]
        self._trained[f"{kind}s"] += 1
        self._trained["train_loss"] = out["loss"]

    def _fill_features(self, data: list[TrainingRollout]) -> None:
        """Features for up to ``feature_rollouts`` shown-only rollouts (newest first), by the policy."""
        import torch
        policy = self._need_policy()
        base = getattr(policy, policy.base_model_prefix)
        device = next(policy.parameters()).device
        todo = [s for s in reversed(data) if s.feats is None and s.tokens][:self.feature_rollouts]
        with torch.inference_mode():
            for s in todo:  # the feature at position len(prompt) - 1 + j sampled token j
                ids = torch.tensor([s.prompt + s.tokens[:-1]], device=device)
                hidden = base(input_ids=ids).last_hidden_state[0, len(s.prompt) - 1:]
                s.feats = hidden.float().clone()

    # ----- a rollout's life -----
    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        """A new row; the first ``feature_rollouts`` of a step keep every feature (training data),
        the others only the window the head reads (memory: rows x window x hidden)."""
        super().start(key, prompt)
        self._feats[key] = []
        online = sum(s.feats is not None for s in self._by_step.get(self._step, []))
        if online + len(self._collect) < self.feature_rollouts:
            self._collect.add(key)

    def observe_features(self, key: RolloutKey, feats) -> None:
        """The features behind the tokens the next ``observe`` brings (one per token, in order)."""
        self._feats.setdefault(key, []).append(feats.detach().float())

    def begin_iteration(self, live, budget: int | None = None) -> None:
        import torch
        self._ready = {}
        k = self.max_spec_tokens if budget is None else min(budget, self.max_spec_tokens)
        if self.lm is None or k <= 0 or not live:
            return
        keys = [key for key, _ in live if self._feats.get(key)]
        if not keys:
            return
        rows = []
        for key in keys:
            parts = self._feats[key]
            if len(parts) > 1 and key not in self._collect:  # only what the window reads, in one tensor
                parts[:] = [torch.cat(parts)[-self.window:]]
            tail = torch.cat(parts[-self.window:])[-self.window:] if len(parts) > 1 else parts[0][-self.window:]
            rows.append((tail, self._outputs[key][-len(tail):]))
        chains = self.lm.propose(rows, k)
        self._ready = {key: Draft(t, None, lp) for key, (t, lp) in zip(keys, chains)}

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        if key not in self._ready and not self._feats.get(key):
            return Draft()  # no feature yet (the first token is not sampled): nothing to draft from
        return super().propose(key, output, budget)

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        import torch
        parts = self._feats.pop(key, None)
        tokens = list(rollout.token_ids)
        feats = None
        if parts and key in self._collect:
            f = torch.cat(parts)
            feats = f if len(f) == len(tokens) else None  # else computed by the policy if training needs it
        self._collect.discard(key)
        self._by_step.setdefault(self._step, []).append(TrainingRollout(list(rollout.prompt_token_ids), tokens, feats))
        self._prompts.pop(key, None)
        self._outputs.pop(key, None)
        keep = sorted(self._by_step)[-(self.history_steps + self.lag + 1):]
        self._by_step = {s: self._by_step[s] for s in keep}

    def stats(self) -> dict:
        s = super().stats()
        s["draft_vocab"] = len(self.lm.d2t) if self.lm else 0  # no out-of-vocabulary slot here
        return s

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_policy"] = None  # the engine attaches it again before the next step
        return state
