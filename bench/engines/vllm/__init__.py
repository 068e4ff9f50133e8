"""The vLLM engine adapter (vLLM imported only when an engine is built) and the proposer that lets
vLLM's own speculative path call the suite's drafters."""
