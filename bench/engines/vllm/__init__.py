"""The vLLM engine adapter (vLLM imported only when an engine is built: ``adapter``, with its
request paths in ``decoding``, its LLMs' lifecycle in ``llm`` and its per-rollout and per-step
records in ``inflight``) and the proposer that lets vLLM's own speculative path call the suite's
drafters (``proposer``)."""
