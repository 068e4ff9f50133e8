"""Exact verification on vLLM without full-vocabulary logprobs: node requests
(``bench.spec.node_backend``) read by a vLLM logits processor on the worker.

    python -m pytest -m vllm tests/test_engine_vllm.py -k "python_verified or worker"

``processor_class`` is a vLLM v1 logits processor: vLLM applies it (as not argmax-invariant)
before temperature, to the float32 logits of every request it samples; it keeps the tag of each
tagged request by batch index (``update_state``) and stores ``reads_from_logits``'s
:class:`NodeRead` of those rows in ``READS``, which the engine's ``submit`` takes. vLLM runs
in-process here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the ``custom_class`` proposer needs), so
``READS`` is shared memory. vLLM refuses custom logits processors beside a speculative config, so
node requests run on the LLM without one (``VLLMEngine.node_llm``); on CPU it uses KV blocks of 32
tokens (``CPU_BLOCK_SIZE``, the smallest its attention takes): a node recomputes at most a block
plus its depth, the rest comes from the prefix cache (shared by requests of one step).

The same processor reads what a generation request at a temperature other than 0 or 1 needs for
its logprobs (tagged ``TEMPER``): vLLM returns the sampled token's raw logprob, log_softmax(z)[x],
and the suite's is log_softmax(z / T)[x] = (raw + lse(z)) / T - lse(z / T); the processor keeps the
two log-partitions of each row, by output position (``READS.partitions``), so no request asks for
the whole distribution (``logprobs=-1``) to rescale it.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from bench.core.verify import NodeRead
from bench.spec.node_backend import NodeBackend, NodeVerifier, reads_from_logits

TAG = "specrollout_node"  # the SamplingParams.extra_args key of a node request
TEMPER = "specrollout_temper"  # ... of a generation request whose tempered logprobs are read here
CPU_BLOCK_SIZE = 32


class _Reads:
    """What the processor computed, by request id, until ``submit`` (node reads) or the decoder
    (log-partitions: output position -> (lse(z), lse(z / T))) takes it."""

    def __init__(self):
        self.reads: dict[str, NodeRead] = {}
        self.partitions: dict[str, dict[int, tuple[float, float]]] = {}


def _move(rows: dict, a: int, b: int, swap: bool) -> None:
    """vLLM moved the request at batch index ``a`` to ``b`` (or swapped the two)."""
    ra, rb = rows.pop(a, None), rows.pop(b, None)
    if ra is not None:
        rows[b] = ra
    if swap and rb is not None:
        rows[a] = rb


READS = _Reads()


@lru_cache(maxsize=1)
def processor_class():
    """vLLM's LogitsProcessor subclass that reads tagged requests (built on first use: vLLM is
    imported only where it is installed)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor, MoveDirectionality

    class NodeReadProcessor(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.tags: dict[int, list] = {}  # batch index -> the request's tag
            self.tempered: dict[int, tuple] = {}  # batch index -> (request id, T, its output token ids)

        def is_argmax_invariant(self) -> bool:
            return False  # so vLLM applies it before temperature, to the float32 logits

        def update_state(self, batch_update) -> None:
            if batch_update is None:
                return
            for i in batch_update.removed:
                self.tags.pop(i, None)
                self.tempered.pop(i, None)
            for i, params, _, output_ids in batch_update.added:
                extra = params.extra_args or {}
                self.tags.pop(i, None)
                self.tempered.pop(i, None)
                if extra.get(TAG) is not None:
                    self.tags[i] = extra[TAG]
                if extra.get(TEMPER) is not None:
                    self.tempered[i] = (extra[TEMPER], float(params.temperature), output_ids)
            for a, b, direction in batch_update.moved:
                swap = direction == MoveDirectionality.SWAP
                _move(self.tags, a, b, swap)
                _move(self.tempered, a, b, swap)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            live = [(i, t) for i, t in self.tags.items() if i < logits.shape[0]]
            if live:
                rows = torch.tensor([i for i, _ in live], dtype=torch.int64, device=logits.device)
                for (_, t), rd in zip(live, reads_from_logits(logits[rows], [t for _, t in live])):
                    READS.reads[t[0]] = rd
            tempered = [(i, v) for i, v in self.tempered.items() if i < logits.shape[0]]
            if tempered:
                rows = torch.tensor([i for i, _ in tempered], dtype=torch.int64, device=logits.device)
                z = logits[rows]  # float32: a float64 copy of every row's vocabulary each step costs more than it adds
                temps = torch.tensor([v[1] for _, v in tempered], dtype=z.dtype, device=z.device)
                lse, lse_t = torch.logsumexp(z, -1).tolist(), torch.logsumexp(z / temps[:, None], -1).tolist()
                for (_, (rid, _, out)), a, b in zip(tempered, lse, lse_t):
                    READS.partitions.setdefault(rid, {})[len(out)] = (a, b)  # the position about to be sampled
            return logits

    return NodeReadProcessor


def vllm_submit(engine, llm):
    """``submit`` for ``NodeVerifier``: one-token requests on ``llm``, stepped to the end."""
    from vllm import SamplingParams

    def submit(items: list[tuple[str, list[int], list]]) -> dict[str, NodeRead]:
        engine._run(llm, [(rid, ids, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                                    extra_args={TAG: tag})) for rid, ids, tag in items], log=False)
        return {rid: READS.reads.pop(rid) for rid, _, _ in items if rid in READS.reads}

    return submit


def node_verifier(engine, llm) -> NodeVerifier:
    """A ``NodeVerifier`` on vLLM (request ids unique within the engine's call)."""
    return NodeVerifier(vllm_submit(engine, llm), engine.info.vocab_size, prefix=f"n{engine._calls}:")


def node_backend(engine, llm) -> NodeBackend:
    """The scheduler's backend on vLLM."""
    return NodeBackend(node_verifier(engine, llm), lambda s: set(engine.info.eos_token_ids) | set(s.stop_token_ids),
                       engine._fits)
