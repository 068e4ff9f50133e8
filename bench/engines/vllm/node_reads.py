"""Exact verification on vLLM without full-vocabulary logprobs: the rule's reading of each draft
node is computed on vLLM's worker, where the logits are, and only its few numbers come back.

    python -m pytest -m vllm tests/test_engine_vllm.py -k "scheduler or node"

The coupled rule (``bench.core.verify``) needs, at every draft node, the coupled inverse-CDF sample
of the processed distribution (temperature, top-k, top-p), so a request for logprobs would need
the whole vocabulary at every position: (prompt + draft) x 152k Python objects a row, and vLLM
skips its prefix cache for prompt-logprob requests. Instead every node of a draft tree becomes a
request of one new token over context + the node's path, tagged with its rollout key, output
position and probe tokens (its children's draft tokens). ``processor_class`` is a vLLM logits
processor that sees each tagged request's float32 logits before vLLM samples and stores
``bench.core.verify.read_logits``'s :class:`NodeRead` (the sample, logprobs and margins) here;
vLLM's own sample is discarded. Requests of one pass share their context through vLLM's prefix
cache (on CPU in blocks of 32 tokens, ``CPU_BLOCK_SIZE``: a node recomputes at most a block plus
its depth), and a long draft is read in the verifier's windows, so a first draft rejected early
costs a few dozen requests, not its length.

vLLM refuses custom logits processors with a speculative config, so these requests run on the LLM
without one (``VLLMEngine.node_llm``). ``NodeBackend`` is the one scheduler's backend
(``bench.spec.scheduler``): the engine's Python-verified path is that scheduler over vLLM, with
the same calls, caps, counters and iteration log as torch_ref.
"""
from __future__ import annotations

import time
from functools import lru_cache

import torch

from methods.base import Draft

from bench.core.engine_protocol import Request
from bench.core.sampling import SamplingConfig
from bench.core.verify import (CHUNK_BYTES, NodeRead, Verdict, VerifyConfig, node_depths, node_probes, read_logits,
                               verify_nodes)
from bench.spec.scheduler import LiveRow, PassResult

TAG = "specrollout_node"  # the SamplingParams.extra_args key of a node request
CPU_BLOCK_SIZE = 32  # the smallest KV block vLLM's CPU attention takes: the prefix cache's granularity


class _Reads:
    """What the processor computed, by request id, until the backend takes it."""

    def __init__(self):
        self.reads: dict[str, NodeRead] = {}


READS = _Reads()


@lru_cache(maxsize=1)
def processor_class():
    """vLLM's LogitsProcessor subclass that reads tagged requests (built on first use: vLLM is
    imported only where it is installed)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor, MoveDirectionality

    class NodeReadProcessor(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.tags: dict[int, list] = {}  # batch index -> the request's tag

        def is_argmax_invariant(self) -> bool:
            return False  # so vLLM applies it before temperature, to the float32 logits

        def update_state(self, batch_update) -> None:
            if batch_update is None:
                return
            for i in batch_update.removed:
                self.tags.pop(i, None)
            for i, params, _, _ in batch_update.added:
                tag = (params.extra_args or {}).get(TAG)
                if tag is None:
                    self.tags.pop(i, None)
                else:
                    self.tags[i] = tag
            for a, b, direction in batch_update.moved:
                ta, tb = self.tags.pop(a, None), self.tags.pop(b, None)
                if ta is not None:
                    self.tags[b] = ta
                if direction == MoveDirectionality.SWAP and tb is not None:
                    self.tags[a] = tb

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            live = [(i, t) for i, t in self.tags.items() if i < logits.shape[0]]
            if not live:
                return logits
            by_rule: dict[tuple, list] = {}
            for i, t in live:
                by_rule.setdefault(tuple(t[4:]), []).append((i, t))
            # the verifier's workspace bound: CHUNK_BYTES of fp32 logits at a time
            chunk = max(1, CHUNK_BYTES.get(logits.device.type, CHUNK_BYTES["cpu"]) // (4 * logits.shape[-1]))
            for (temperature, top_p, top_k, greedy), tagged in by_rule.items():
                sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
                for s in range(0, len(tagged), chunk):
                    group = tagged[s:s + chunk]
                    idx = torch.tensor([i for i, _ in group], dtype=torch.int64, device=logits.device)
                    reads = read_logits(logits[idx], [t[1] for _, t in group], [t[2] for _, t in group],
                                        [t[3] for _, t in group], sampling, greedy)
                    for (_, t), rd in zip(group, reads):
                        READS.reads[t[0]] = rd
            return logits

    return NodeReadProcessor


def path_tokens(draft: Draft, node: int) -> list[int]:
    """The draft tokens from the root to local node ``node`` (0 = the root: none)."""
    parents = draft.parent_list()
    out = []
    while node > 0:
        out.append(draft.token_ids[node - 1])
        node = parents[node - 1] + 1
    return out[::-1]


class NodeVerifier:
    """Verifies drafts by node requests on one LLM (see the module docstring)."""

    def __init__(self, engine, llm):
        self.engine, self.llm = engine, llm
        self.requests = 0  # node requests sent (a pass's cost on vLLM, beside its forward seconds)

    def verify(self, contexts: list[list[int]], drafts: list[Draft], keys: list[int], out_lens: list[int],
               sampling: SamplingConfig, verify: VerifyConfig) -> tuple[list[Verdict], float]:
        """The rule's verdict of each row's draft after its context; and the seconds vLLM ran."""
        from vllm import SamplingParams
        greedy = verify.rule == "greedy" or sampling.greedy
        probes = [node_probes(d) for d in drafts]
        depths = [node_depths(d) for d in drafts]
        forward = [0.0]
        engine = self.engine

        def reads_at(pairs: list[tuple[int, int]]) -> list[NodeRead]:
            items = []
            for b, j in pairs:
                rid = f"n{engine._calls}:{self.requests}"
                self.requests += 1
                tag = [rid, keys[b], out_lens[b] + depths[b][j], probes[b][j], float(sampling.temperature),
                       float(sampling.top_p), int(sampling.top_k), greedy]
                params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={TAG: tag})
                items.append((rid, contexts[b] + path_tokens(drafts[b], j), params))
            t0 = time.perf_counter()
            engine._run(self.llm, items, log=False)
            forward[0] += time.perf_counter() - t0
            missing = [rid for rid, _, _ in items if rid not in READS.reads]
            if missing:
                raise RuntimeError(f"vLLM's logits processor read no logits for node requests {missing[:3]}: was the "
                                   f"LLM built with bench.engines.vllm.node_reads.processor_class()?")
            return [READS.reads.pop(rid) for rid, _, _ in items]

        verdicts = verify_nodes(None, engine.info.vocab_size, drafts, torch.tensor(keys, dtype=torch.int64), out_lens,
                                sampling, verify, reads_at=reads_at)
        return verdicts, forward[0]


class NodeBackend:
    """The scheduler's backend on vLLM: each pass verifies its rows' drafts by node requests.
    vLLM keeps no state of a row between passes (its prefix cache holds the KV), so admitting,
    committing and releasing rows are no-ops."""

    def __init__(self, engine, llm):
        self.engine = engine
        self.verifier = NodeVerifier(engine, llm)

    def stops(self, sampling: SamplingConfig) -> set[int]:
        return set(self.engine.info.eos_token_ids) | set(sampling.stop_token_ids)

    def fits(self, request: Request, sampling: SamplingConfig) -> bool:
        return self.engine._fits(request, sampling)

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
