"""Benchmarks: one module each, run through one command (``python -m bench.benchmarks NAME``).
Timings here are measured side by side in one run and logged in results/LOG.md; no test asserts a speed."""
