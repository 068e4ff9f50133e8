"""The torch reference engine: exact by construction, CPU or GPU, a slot KV cache and a ragged
block forward pass; its timing and latency-table profiling."""
