"""vLLM's ``custom_class`` speculative proposer that asks the suite's drafter for every draft.

    python -m pytest -m vllm tests/test_engine_vllm.py -k tree

vLLM builds ``SuiteProposer(vllm_config)`` inside its model runner and calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)`` after every
step, with no request ids. The engine runs vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
registers the runner and a :class:`Session` here before driving a batch, and names each request
itself, so row i of the call is request ``runner.input_batch.req_ids[i]`` (vLLM appends
``-<8 random chars>`` to the id it was given). The session maps that id to the rollout's key and
replays the Drafter protocol: ``observe`` the tokens the step emitted (cut at a stop token and at
max_new_tokens, and counted, by ``bench.core.drafting.settle``: the same cut and counters as every
engine), then ``propose`` with the output so far; each call first reports the live rows
(``bench.core.drafting.report_live``; output lengths count the step's new tokens before any cut).
Drafts must be chains: a tree draft is
cut to its first root-to-leaf path (a proposal only, so this stays lossless). vLLM verifies the
chain with its own rejection sampler, treating the draft as certain (probability-free), which is
lossless in distribution. No vLLM import here: the module is imported by vLLM, not by the suite.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from methods.base import Draft, Drafter, RolloutKey

from bench.core.drafting import DraftCounters, report_live, settle


@dataclass
class RowState:
    """What the proposer knows about one live request."""

    key: RolloutKey
    output: list[int]  # emitted so far (including tokens emitted before this request, e.g. a reused prefix)
    max_new_tokens: int
    last_draft: list[int] = field(default_factory=list)
    done: bool = False
    counters: DraftCounters = field(default_factory=DraftCounters)  # one pass per step vLLM ran for it


class Session:
    """The drafter and the live requests of one engine call."""

    def __init__(self, drafter: Drafter | None, stops: set[int], k: int):
        self.drafter = drafter
        self.stops = stops
        self.k = k
        self.rows: dict[str, RowState] = {}

    def add(self, request_id: str, state: RowState) -> None:
        self.rows[request_id] = state

    def row(self, internal_id: str) -> RowState | None:
        state = self.rows.get(internal_id)
        if state is None:  # vLLM's internal id: "<our id>-<8 random chars>"
            state = self.rows.get(internal_id.rsplit("-", 1)[0])
        return state

    def step(self, state: RowState, new: list[int]) -> list[int]:
        """Account for the tokens one step emitted, then draft the next ones."""
        if state.done or not new:  # a chunk of a prefill emits nothing
            return []
        draft, acc = state.last_draft, 0
        while acc < min(len(draft), len(new) - 1) and new[acc] == draft[acc]:
            acc += 1  # how much of the last draft this step accepted (the token after it is the bonus)
        kept = settle(state.counters, len(draft), new, acc, self.stops, len(state.output), state.max_new_tokens)
        new = list(new[:kept.n])
        state.last_draft = []
        state.output += new
        if self.drafter is not None and new:
            self.drafter.observe(state.key, new)
        if kept.finish_reason:
            state.done = True
            return []
        if self.drafter is None:
            return []
        budget = min(self.k, state.max_new_tokens - len(state.output) - 1)
        if budget <= 0:
            return []
        draft = chain_of(self.drafter.propose(state.key, state.output, budget)).truncated(budget)
        state.last_draft = list(draft.token_ids)  # counted when the next step verifies it
        return list(draft.token_ids)


def chain_of(draft: Draft) -> Draft:
    """A chain from a (possibly tree) draft: node 0, then the first child of each node.

    Example: tokens [5, 6, 7, 8] with parents [-1, -1, 0, 2] -> chain [5, 7, 8].
    """
    if draft.is_chain:
        return draft
    parents = draft.parent_list()
    chain, node = [], -1
    for i, p in enumerate(parents):
        if p == node:
            chain.append(i)
            node = i
    return Draft([draft.token_ids[i] for i in chain])


class _Registry:
    runner: Any = None  # vLLM's model runner (in-process), to read the batch's request ids
    session: Session | None = None


REGISTRY = _Registry()


class SuiteProposer:
    """Built by vLLM with its config; forwards every row to the registered session."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)

    def load_model(self, *args: Any, **kwargs: Any) -> None:  # vLLM's CPU runner calls it; no model here
        pass

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any = None,
                token_ids_cpu: Any = None, slot_mappings: Any = None, **kwargs: Any) -> list[list[int]]:
        session, runner = REGISTRY.session, REGISTRY.runner
        if session is None or runner is None:
            return [[] for _ in sampled_token_ids]
        req_ids = runner.input_batch.req_ids
        states = [session.row(req_ids[i]) if i < len(req_ids) and req_ids[i] is not None else None
                  for i in range(len(sampled_token_ids))]
        if session.drafter is not None:  # the live batch, with this step's tokens counted in
            report_live(session.drafter, [(s.key, len(s.output) + len(new)) for s, new
                                          in zip(states, sampled_token_ids) if s is not None and not s.done])
        return [session.step(state, list(new))[:self.k] if state is not None else []
                for state, new in zip(states, sampled_token_ids)]
