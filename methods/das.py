"""DAS (arXiv 2511.13841): per-problem suffix trie over a sliding window of recent steps, with length-aware draft budgets.

    python -m pytest tests/test_drafters.py -q -k das

The trie is the tree cache's (``TreeCacheDrafter``): one per prompt, each rollout a sequence
``[START] + response`` inserted in flight, so the siblings of a GRPO group draft from each other
(the re-implementation's transient self-inserts). Unlike SRT's every-visit history, a sequence
carries the step it ran in and ages out at the first ``begin_step`` at least ``window_steps``
later. Recency: a rollout counts ``recent_weight`` times (extra copies added at ``finish``) until
``recent_steps`` steps have passed, the re-implementation's stand-in for the paper's recency
down-weighting in a count-only tree.

Budget: each prompt keeps an exponential moving average (``ema_alpha`` per finished rollout)
of its rollout lengths. A request is *long* if the average, as it stood when its step began, is
at least ``long_min``, *short* if below ``short_max``, *medium* otherwise (and medium for a
prompt never seen); a running request is upgraded, never downgraded, once its own output
reaches a threshold. The class budget (``long_budget`` / ``medium_budget`` / ``short_budget``;
0 = no draft) caps the draft. With ``length_unit: cap`` the thresholds are fractions of the
rollout length cap, learned from the engine's budgets (``len(output) + budget + 1``: exact in
the torch engine and the simulator, a lower bound under vLLM's ``num_speculative_tokens``);
with ``tokens`` they are token counts. Defaults are the community re-implementation's (its
256 / 1024 tokens at a 4096-token cap as fractions; budgets 24 / 8 / 0; window 16 steps; two
fresh steps counted twice; average weight 0.2), with vLLM ``method: suffix`` knobs depth 24,
factor 2.0, min_prob 0.1 and its best-score rule (docs/papers.md, "Newer anchors").
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from methods.base import Draft, Rollout, RolloutKey
from methods.suffix.tree import START
from methods.tree_cache import TreeCacheDrafter

SHORT, MEDIUM, LONG = 0, 1, 2
CLASS_NAMES = ("short", "medium", "long")
LENGTH_UNITS = ("cap", "tokens")


class DASDrafter(TreeCacheDrafter):
    """Windowed per-prompt trie (16 steps), long/medium/short budgets 24/8/0, factor 2.0."""

    name = "das"

    def __init__(self, max_depth: int = 24, max_spec_tokens: int = 24, factor: float = 2.0,
                 offset: float = 0.0, min_prob: float = 0.1, tree: bool = False, match: str = "best",
                 window_steps: int = 16, recent_steps: int = 2, recent_weight: int = 2,
                 long_budget: int = 24, medium_budget: int = 8, short_budget: int = 0,
                 short_max: float = 0.0625, long_min: float = 0.25, length_unit: str = "cap",
                 ema_alpha: float = 0.2, backend: str = "auto"):
        super().__init__(max_depth=max_depth, max_spec_tokens=max_spec_tokens, factor=factor,
                         offset=offset, min_prob=min_prob, tree=tree, in_flight=True, history=True,
                         run_ahead=False, match=match, backend=backend)
        if length_unit not in LENGTH_UNITS:
            raise ValueError(f"length_unit must be one of {LENGTH_UNITS}, got {length_unit!r}")
        if window_steps < 1 or recent_weight < 1:
            raise ValueError(f"window_steps ({window_steps}) and recent_weight ({recent_weight}) must be >= 1")
        if short_max > long_min:
            raise ValueError(f"short_max ({short_max}) must be <= long_min ({long_min})")
        self.window_steps = window_steps
        self.recent_steps = recent_steps
        self.recent_weight = recent_weight
        self.budgets = (short_budget, medium_budget, long_budget)
        self.short_max = short_max
        self.long_min = long_min
        self.length_unit = length_unit
        self.ema_alpha = ema_alpha
        self._step = 0
        self._cap = 0  # the rollout length cap, as far as the engine's budgets showed it
        self._window: deque[tuple[int, str, int]] = deque()  # (step, prompt, seq id), oldest first
        self._extra: deque[tuple[int, str, int]] = deque()  # recency copies, oldest first
        self._ema: dict[str, float] = {}  # prompt -> moving average of its rollout lengths
        self._frozen: dict[str, float] = {}  # the averages as they stood when the step began

    def reset_stats(self) -> None:
        super().reset_stats()
        self._class_proposals = [0, 0, 0]

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self._step = step
        while self._window and self._window[0][0] <= step - self.window_steps:
            self._forget(*self._window.popleft()[1:])
        while self._extra and self._extra[0][0] <= step - self.recent_steps:
            self._forget(*self._extra.popleft()[1:])
        self._frozen = dict(self._ema)

    def _forget(self, prompt_id: str, seq_id: int) -> None:
        trie = self._tries.get(prompt_id)
        if trie is not None:
            trie.remove(seq_id)
            if not len(trie):
                del self._tries[prompt_id]

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        super().start(key, prompt)
        self._window.append((self._step, key.prompt_id, self._live[key]))

    def length_class(self, prompt_id: str, output_len: int) -> int:
        """SHORT / MEDIUM / LONG: the prompt's class at the start of the step, upgraded by the
        request's own output length (an unseen prompt starts as MEDIUM)."""
        scale = self._cap if self.length_unit == "cap" else 1
        short_max, long_min = self.short_max * scale, self.long_min * scale

        def of(length: float) -> int:
            return LONG if length >= long_min else SHORT if length < short_max else MEDIUM

        past = self._frozen.get(prompt_id)
        return max(MEDIUM if past is None else of(past), of(output_len))

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        """The tree cache's draft, capped by the request's length-class budget.

        Example (cap 24, so short below 1.5 tokens and long from 6): prompt p's rollouts at
        earlier visits averaged 9 tokens, so p is long and its budget is 24; the window holds
        [4, 9, 2, 4, 9, 7]; at output [4, 9] the best match [START, 4, 9] (2 occurrences, 2
        follows once) drafts ``Draft([2, 4, 9, 7])`` (path probability 1/2 throughout, score
        2.0; its budget 3 x factor 2.0 = 6 is cut where that rollout ended). A prompt whose
        rollouts averaged 1 token is short: no draft until its own output reaches 2 tokens. An
        unseen prompt is medium: at most 8 tokens until its output reaches 6.
        """
        self._proposals += 1
        self._cap = max(self._cap, len(output) + budget + 1)
        cls = self.length_class(key.prompt_id, len(output))
        self._class_proposals[cls] += 1
        return self._draft(key, output, min(self.max_spec_tokens, budget, self.budgets[cls]))

    def propose_batch(self, keys: Sequence[RolloutKey], outputs: Sequence[Sequence[int]],
                      budgets: Sequence[int]) -> list[Draft]:
        """``propose`` for each row: the classes row by row, the drafts in one compiled call."""
        if not self.in_flight or self.backend != "compiled":
            return [self.propose(k, o, b) for k, o, b in zip(keys, outputs, budgets)]
        limits, counts, classes = [], self._class_proposals, self.budgets
        for key, output, budget in zip(keys, outputs, budgets):
            n = len(output)
            if n + budget + 1 > self._cap:
                self._cap = n + budget + 1
            cls = self.length_class(key.prompt_id, n)
            counts[cls] += 1
            limits.append(min(budget, classes[cls]))
        self._proposals += len(keys)
        return self._compiled_drafts(keys, outputs, limits)

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        started = key in self._live
        first_free = self._next_seq
        source = self._live.get(key, first_free)  # the rollout's sequence, [START, *tokens] after finish
        super().finish(key, rollout)
        pid, tokens = key.prompt_id, list(rollout.token_ids)
        if not started:  # a finish without start: the tree cache added a new sequence
            self._window.append((self._step, pid, first_free))
        trie = self.trie(pid)
        copy = getattr(trie, "extend_copy", None)  # SuffixIndex: a copy adds no automaton states
        for _ in range(self.recent_weight - 1):
            if copy is not None and source in trie:
                copy(self._next_seq, source)
            else:
                trie.extend(self._next_seq, [START, *tokens])
            self._extra.append((self._step, pid, self._next_seq))
            self._next_seq += 1
        past = self._ema.get(pid)
        n = len(tokens)
        self._ema[pid] = float(n) if past is None else self.ema_alpha * n + (1 - self.ema_alpha) * past

    def stats(self) -> dict:
        out = super().stats()
        out.update({"window_sequences": len(self._window), "recent_copies": len(self._extra),
                    "length_cap": self._cap,
                    **{f"{name}_proposals": c for name, c in zip(CLASS_NAMES, self._class_proposals)}})
        return out
