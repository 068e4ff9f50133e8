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
"""
from __future__ import annotations

from functools import lru_cache

import torch

from bench.core.verify import NodeRead
from bench.spec.node_backend import NodeBackend, NodeVerifier, reads_from_logits

TAG = "specrollout_node"  # the SamplingParams.extra_args key of a node request
CPU_BLOCK_SIZE = 32


class _Reads:
    """What the processor computed, by request id, until ``submit`` takes it."""

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
            if live:
                rows = torch.tensor([i for i, _ in live], dtype=torch.int64, device=logits.device)
                for (_, t), rd in zip(live, reads_from_logits(logits[rows], [t for _, t in live])):
                    READS.reads[t[0]] = rd
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
