"""A scheduler backend for engines that verify by reading draft nodes on their own worker.

    python -m pytest tests/test_verify.py -k reads_computed      (engine-side: -m vllm / -m sglang)

The coupled rule (``bench.core.verify``) needs, at every draft node, the coupled inverse-CDF sample
of the processed distribution, so asking an engine for logprobs would need the whole vocabulary
at every position (152k Python objects a position on vLLM, ``top_logprobs_num=V`` on SGLang).
Instead every node of a draft tree becomes a request of one new token over context + the node's
path, tagged with what the rule needs (``node_tag``: the rollout key, the output position, the
probe tokens, the sampling rule); a logits processor inside the engine hands each tagged row's
logits to ``reads_from_logits``, which runs ``bench.core.verify.read_logits`` there, and only the
sample, logprobs and margins come back (``NodeRead``). The engine's own sample of those requests is
discarded. Requests of one pass share their context through the engine's prefix cache, and a long
draft is read in the verifier's windows (``verify_nodes``), so a first draft rejected early costs a
few dozen requests, not its length.

``NodeVerifier`` turns a pass of drafts into such requests through an engine's ``submit`` and
returns the rule's verdicts; ``NodeBackend`` is the one scheduler's backend over it
(``bench.spec.scheduler``). vLLM (``bench.engines.vllm.node_reads``) and SGLang
(``bench.engines.sglang.node_reads``) supply ``submit`` and the processor.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from methods.base import Draft

from bench.core.engine_protocol import Request
from bench.core.sampling import SamplingConfig
from bench.core.verify import (CHUNK_BYTES, NodeRead, Verdict, VerifyConfig, node_depths, node_probes, read_logits,
                               verify_nodes)
from bench.spec.scheduler import LiveRow, PassResult

# submit(items): run one-token requests (request id, token ids, tag) on the engine and return the
# NodeRead its processor computed for each request id
Submit = Callable[[list[tuple[str, list[int], list]]], dict[str, NodeRead]]


def node_tag(rid: str, key64: int, position: int, probes: list[int], sampling: SamplingConfig, greedy: bool) -> list:
    """What the engine-side processor needs of one node request, as JSON-safe values."""
    return [rid, int(key64), int(position), [int(t) for t in probes], float(sampling.temperature),
            float(sampling.top_p), int(sampling.top_k), bool(greedy)]


def reads_from_logits(logits: torch.Tensor, tags: Sequence[list]) -> list[NodeRead]:
    """The engine side: the rule's reading of each row of ``logits`` [n, V] under its tag, a chunk
    of the verifier's workspace at a time (``CHUNK_BYTES`` of fp32 logits)."""
    out: list[NodeRead | None] = [None] * len(tags)
    by_rule: dict[tuple, list[int]] = {}
    for i, t in enumerate(tags):
        by_rule.setdefault(tuple(t[4:]), []).append(i)
    chunk = max(1, CHUNK_BYTES.get(logits.device.type, CHUNK_BYTES["cpu"]) // (4 * logits.shape[-1]))
    for (temperature, top_p, top_k, greedy), rows in by_rule.items():
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
        for s in range(0, len(rows), chunk):
            part = rows[s:s + chunk]
            idx = torch.tensor(part, dtype=torch.int64, device=logits.device)
            reads = read_logits(logits[idx], [tags[i][1] for i in part], [tags[i][2] for i in part],
                                [tags[i][3] for i in part], sampling, greedy)
            for i, rd in zip(part, reads):
                out[i] = rd
    return out


def path_tokens(draft: Draft, node: int) -> list[int]:
    """The draft tokens from the root to local node ``node`` (0 = the root: none)."""
    parents = draft.parent_list()
    out = []
    while node > 0:
        out.append(draft.token_ids[node - 1])
        node = parents[node - 1] + 1
    return out[::-1]


class NodeVerifier:
    """Verifies drafts by node requests through ``submit`` (see the module docstring);
    ``requests`` counts what was sent, a pass's cost on the engine beside its forward seconds."""

    def __init__(self, submit: Submit, vocab: int, prefix: str = "n"):
        self.submit, self.vocab, self.prefix = submit, vocab, prefix
        self.requests = 0

    def verify(self, contexts: list[list[int]], drafts: list[Draft], keys: list[int], out_lens: list[int],
               sampling: SamplingConfig, verify: VerifyConfig) -> tuple[list[Verdict], float]:
        """The rule's verdict of each row's draft after its context; and the seconds the engine ran."""
        greedy = verify.rule == "greedy" or sampling.greedy
        probes = [node_probes(d) for d in drafts]
        depths = [node_depths(d) for d in drafts]
        forward = [0.0]

        def reads_at(pairs: list[tuple[int, int]]) -> list[NodeRead]:
            items = []
            for b, j in pairs:
                rid = f"{self.prefix}{self.requests}"
                self.requests += 1
                tag = node_tag(rid, keys[b], out_lens[b] + depths[b][j], probes[b][j], sampling, greedy)
                items.append((rid, contexts[b] + path_tokens(drafts[b], j), tag))
            t0 = time.perf_counter()
            got = self.submit(items)
            forward[0] += time.perf_counter() - t0
            missing = [rid for rid, _, _ in items if rid not in got]
            if missing:
                raise RuntimeError(f"the engine's logits processor read no logits for node requests {missing[:3]}: "
                                   f"was the engine built with the suite's node-reading processor?")
            return [got[rid] for rid, _, _ in items]

        verdicts = verify_nodes(None, self.vocab, drafts, torch.tensor(keys, dtype=torch.int64), out_lens,
                                sampling, verify, reads_at=reads_at)
        return verdicts, forward[0]


class NodeBackend:
    """The scheduler's backend over a ``NodeVerifier``: each pass verifies its rows' drafts by node
    requests. The engine keeps no state of a row between passes (its prefix cache holds the KV),
    so admitting, committing and releasing rows are no-ops."""

    def __init__(self, verifier: NodeVerifier, stops: Callable[[SamplingConfig], set[int]],
                 fits: Callable[[Request, SamplingConfig], bool]):
        self.verifier, self._stops, self._fits = verifier, stops, fits

    def stops(self, sampling: SamplingConfig) -> set[int]:
        return self._stops(sampling)

    def fits(self, request: Request, sampling: SamplingConfig) -> bool:
        return self._fits(request, sampling)

    def start_call(self, sampling: SamplingConfig) -> None:
        pass

    def admit(self, rows: list[LiveRow], sampling: SamplingConfig) -> None:
        pass

    def forward(self, rows: list[LiveRow], group: list[int], drafts: list[Draft], sampling: SamplingConfig,
                verify: VerifyConfig) -> PassResult:
        t0 = time.perf_counter()
        chosen = [rows[i] for i in group]
        verdicts, forward_s = self.verifier.verify(
            [list(r.request.prompt_token_ids) + r.output for r in chosen], drafts, [r.key64 for r in chosen],
            [len(r.output) for r in chosen], sampling, verify)
        return PassResult(verdicts, forward_s, time.perf_counter() - t0 - forward_s)

    def commit(self, rows: list[LiveRow], verdicts: list[Verdict]) -> None:
        pass

    def release(self, keep: list[int], rows: list[LiveRow]) -> None:
        pass
