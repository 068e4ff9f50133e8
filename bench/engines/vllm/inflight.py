"""What VLLMEngine (bench.engines.vllm.adapter) keeps while a call runs: ``InFlightRollout``, one
rollout's tokens, logprobs, counters and times across the scoring and generation phases, and
``StepLog``, one ``engine.step()`` as a row of ``last_iteration_log`` (iterations.parquet).
No vLLM import: both read only what vLLM's request outputs carry.

    python -m pytest -m vllm tests/test_engine_vllm.py     (in the environment that has vLLM: bash .ci/engine-vllm.sh)
"""
from __future__ import annotations

from methods.base import Rollout

from bench.core.drafting import DraftCounters
from bench.core.engine_protocol import Request


class InFlightRollout:
    """A rollout in flight: tokens and counters gathered over the scoring and generation phases."""

    def __init__(self, request: Request, key64: int):
        self.request, self.key64 = request, key64
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.counters = DraftCounters()
        self.first_t = self.last_t = self.first_gen_t = 0.0
        self.finish_reason = ""
        self.seen = self.finished_gen = False
        self.told_finished = False  # drafter.finish already called for this row
        self.partial = None  # run-ahead: the last cumulative output seen (kept if the row is aborted)

    def to_rollout(self) -> Rollout:
        r = self.request
        return Rollout(key=r.key, step=r.step, prompt_token_ids=list(r.prompt_token_ids), token_ids=list(self.output),
                       logprobs=list(self.logprobs), finish_reason=self.finish_reason, **self.counters.as_dict(),
                       first_token_time=self.first_t, last_token_time=self.last_t, run_ahead=r.run_ahead,
                       anticipates=r.anticipates)


class StepLog:
    """One ``engine.step()`` as an iterations.parquet row, from what vLLM's outputs expose: the rows
    that produced tokens, the tokens they emitted, their contexts. A row seen for the first time
    was prefilled, so its prompt counts as query tokens. vLLM reports no per-step draft length:
    ``draft_tokens`` is left empty and ``query_tokens`` counts prompts plus emitted tokens (on a
    speculative step a lower bound: rejected draft tokens are not visible); ``accepted_tokens`` is
    what decode rows emitted beyond one token each (the Python-verified path is logged by the
    scheduler, ``bench.spec.scheduler``, as on torch_ref). ``forward_s`` is the whole step (scheduler, forward, sampler, and
    the proposer, the suite's drafter included); ``other_s`` is the adapter's bookkeeping after it."""

    def __init__(self):
        self.rows = self.ahead = self.query = self.accepted = self.context_sum = self.context_max = 0

    def add(self, o, seen: dict[str, int]) -> None:
        n = len(o.outputs[0].token_ids) if o.outputs else 0
        before = seen.get(o.request_id)
        new = n - (before or 0)
        if new <= 0 and before is not None:
            return
        prompt = len(o.prompt_token_ids or [])
        self.rows += 1
        self.ahead += o.request_id.startswith("a")  # run-ahead requests (``VLLMDecoding._generate``'s ids)
        self.query += new + (prompt if before is None else 0)
        self.accepted += max(new - 1, 0) if before is not None else 0
        self.context_sum += prompt + n
        self.context_max = max(self.context_max, prompt + n)
        seen[o.request_id] = n

    def row(self, iteration: int, live: int, budget: int, step_s: float, other_s: float) -> dict:
        return {"iteration": iteration, "call": 0, "rows": self.rows, "live_rows": live,
                "run_ahead_rows": self.ahead, "query_tokens": self.query, "block_tokens": self.query,
                "context_sum": self.context_sum, "context_max": self.context_max, "draft_tokens": None,
                "accepted_tokens": self.accepted, "draft_budget": budget, "forward_s": step_s,
                "verify_s": 0.0, "drafter_s": None, "other_s": other_s}
