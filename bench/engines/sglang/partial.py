"""A rollout being assembled by SGLangEngine (bench.engines.sglang.adapter): the tokens of a
verified prefix (bench.engines.sglang.scoring), then SGLang's continuation, with their logprobs,
counters and times, until it becomes the Rollout the engine returns. No SGLang import.

    python -m pytest -m sglang tests/test_engine_sglang.py   (CPU: in the rig venv, rigs/sglang_cpu/)
"""
from __future__ import annotations

from methods.base import Rollout

from bench.core.drafting import DraftCounters
from bench.core.engine_protocol import Request


class PartialRollout:
    """One rollout being assembled from a verified prefix and an SGLang continuation."""

    def __init__(self, request: Request, key64: int):
        self.request, self.key64 = request, key64
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.counters = DraftCounters()
        self.first_t = self.last_t = 0.0
        self.finish_reason = ""

    def emit(self, tokens: list[int], lps: list[float], first: float | None, last: float | None = None) -> None:
        if not tokens:
            return
        if not self.output and first is not None:
            self.first_t = first
        self.output += tokens
        self.logprobs += lps
        self.last_t = last if last is not None else first

    def to_rollout(self) -> Rollout:
        r = self.request
        return Rollout(key=r.key, step=r.step, prompt_token_ids=list(r.prompt_token_ids), token_ids=self.output,
                       logprobs=self.logprobs, finish_reason=self.finish_reason or "length",
                       **self.counters.as_dict(), first_token_time=self.first_t,
                       last_token_time=self.last_t, run_ahead=r.run_ahead)
