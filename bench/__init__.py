"""SpecRollout's harness: sampling, the verifier, engines, traces, replay, simulation, results."""
