"""SpecRollout's harness, in layers that import only downward (docs/architecture.md):

    bench.core        sampling, the verifier, precision, the engine protocol, errors, paths
    bench.spec        the one speculation loop: the scheduler, policies, latency tables, roofline, prices
    bench.knobs       every method's and engine's knobs: types, ranges, checks
    bench.report      results on disk, collection, tables and figures
    bench.engines     backends of the scheduler: torch (the reference), vLLM, SGLang
    bench.traces      recorded RL runs: the format, importers, the recorder, the real model
    bench.harness     the main job (replay), the simulator and their command lines
    bench.benchmarks  side-by-side timings (python -m bench.benchmarks NAME)
    bench.train       the closed loop: GRPO on the suite's own policy

``methods`` (the drafters) sits below all of these and imports neither torch nor an engine.
"""
