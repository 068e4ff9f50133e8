"""One command for every benchmark: ``python -m bench.benchmarks NAME [flags]``.

    python -m bench.benchmarks engine-vs-hf    # torch_ref vs transformers generate, batch 1 and 32
    python -m bench.benchmarks oracle          # the oracle drafter's speedup, budgets 4/8/16, 256 tokens
    python -m bench.benchmarks suffix-tree     # suffix trie append / speculate cost per token
    python -m bench.benchmarks suffix-tree --live-rows 256   # drafter ms per iteration, python vs native
    python -m bench.benchmarks drafter-cost    # drafter seconds as a share of rollout seconds, on a trace
    python -m bench.benchmarks near-ties       # CDF shift, batched/tree vs one-token forward, per dtype
    python -m bench.benchmarks identity        # the identity rate of every exact method in one dtype
    python -m bench.benchmarks simulate-scale  # the simulator on 8 steps x 128 rollouts x 4,096 tokens
    python -m bench.benchmarks simulate-scale --size ten-step --jobs 2   # 10 steps x 1,024 rollouts, the copying methods
    python -m bench.benchmarks policies        # each method's speedup under every speculation policy
    python -m bench.benchmarks verify-scale    # the verifier at V=151,936, B=128, 4,096-token chains
    python -m bench.benchmarks memory          # one torch_ref pass at Qwen2.5-0.5B's shapes: peak memory
    python -m bench.benchmarks vllm-scoring    # vLLM's Python-verified path at V=151,936: memory, s/iteration
    python -m bench.benchmarks lora-costs      # a LoRA GRPO run on SmolLM2: delta size, merge, one gradient step
    python -m bench.benchmarks bias            # the lenient rule's bias on the bundled trace
    python -m bench.benchmarks latency profile|predict   # this machine's latency table; predictions
    python -m bench.benchmarks gpu-check       # the GPU check (one prepared run on a lent GPU)
    python -m bench.benchmarks train-idle RUN  # learned drafters' training seconds against the tail's idle time

``NAME --help`` lists a benchmark's flags. Each module is imported only when its benchmark runs,
so one benchmark's heavy imports never slow another.
"""
from __future__ import annotations

import importlib
import sys

from bench.core.errors import UserError

# name -> (module under bench.benchmarks, function taking argv)
BENCHMARKS = {
    "engine-vs-hf": ("engine", "engine_vs_hf_main"),
    "oracle": ("engine", "oracle_main"),
    "suffix-tree": ("suffix_tree", "main"),
    "drafter-cost": ("drafter_cost", "main"),
    "near-ties": ("near_ties", "near_ties_main"),
    "identity": ("near_ties", "identity_main"),
    "simulate-scale": ("simulate_scale", "main"),
    "policies": ("policy", "main"),
    "verify-scale": ("verify_scale", "main"),
    "memory": ("memory", "main"),
    "vllm-scoring": ("vllm_scoring", "main"),
    "lora-costs": ("lora_costs", "main"),
    "bias": ("bias", "main"),
    "latency": ("latency", "main"),
    "gpu-check": ("gpu_check", "main"),
    "train-idle": ("train_idle", "main"),
}


def resolve(name: str):
    """The ``main(argv)`` of benchmark ``name``; an unknown name is one error listing the known ones."""
    if name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}: choose one of {', '.join(BENCHMARKS)} "
                        "(python -m bench.benchmarks --help)")
    module, function = BENCHMARKS[name]
    return getattr(importlib.import_module(f"bench.benchmarks.{module}"), function)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    try:
        run = resolve(argv[0])
    except UserError as err:
        sys.exit(f"error: {err}")
    run(argv[1:])


if __name__ == "__main__":
    main()
