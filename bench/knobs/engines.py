"""Each engine's settings, the sampling group and the verify rule declared once (no torch or engine import).

    python -m bench.harness.cli engine=vllm --knobs     # one engine's table, from ENGINES below

``ENGINES`` maps conf/engine/NAME.yaml to its settings in the engine constructor's order (``name``
selects the engine and is not a setting); ``SAMPLING`` is conf/sampling/ (null: the trace's recorded
value); ``VERIFY`` is each method's ``verify`` node. tests/test_knobs.py checks them against the
constructors, bench.core.sampling.SamplingConfig, bench.core.verify and the YAML files.
"""
from __future__ import annotations

from bench.knobs import Knob

DTYPES = ("bfloat16", "float16", "float32", "float64")  # bench/engines/torch/engine.py DTYPES
VLLM = "vLLM's offline LLM"
SGL = "SGLang's offline Engine"
_PLAIN = "drafter modes served by an engine with no speculative config ([] = all on the speculative one)"

ENGINES: dict[str, tuple[Knob, ...]] = {
    "torch_ref": (
        Knob("device", "str", "cpu", "torch device: cpu, cuda, cuda:N"),
        Knob("dtype", "str", "float32", "weights and activations (float64 for bit-exact identity tests)",
             choices=DTYPES),
        Knob("attn_implementation", "str", "sdpa", "transformers attention implementation (sdpa, eager, ...)"),
        Knob("max_batch_size", "int", None, "live rollouts at once, continuous batching (null: the whole step)",
             lo=1, nullable=True),
        Knob("threads", "int", None, "CPU intra-op threads (null: torch's default); 1 is fastest for the "
             "bundled ~1M-parameter policy", lo=1, nullable=True),
        Knob("spec_policy", "str", "fixed", "per-iteration draft cap: fixed, batch_threshold (vLLM "
             "disable_by_batch_size), throughput_optimal", choices=("fixed", "batch_threshold", "throughput_optimal")),
        Knob("spec_max_rows", "int", 32, "batch_threshold: no drafts while more rows than this are live",
             "paper", "TLT / FastRL bs_threshold 32", lo=0),
        Knob("latency_table", "str", None, "throughput_optimal and seconds=table: auto (profiled once) or a CSV from "
             "bench.benchmarks latency profile", nullable=True),
        Knob("seconds", "str", "measured", "measured: the clock; table: every pass priced by latency_table and "
             "nothing else timed (reproducible decisions, equal to bench.harness.simulate)", choices=("measured", "table")),
    ),
    "vllm": (
        Knob("dtype", "str", "float32", "vLLM's dtype (float32 as torch_ref's default)",
             choices=("auto", "bfloat16", "float16", "float32")),
        Knob("gpu_memory_utilization", "float", 0.1, "share of GPU memory (CPU: of host RAM) per LLM for its KV "
             "cache", lo=0, hi=1, open_lo=True),
        Knob("max_model_len", "int", None, "context length (null: the checkpoint's max_position_embeddings)",
             "released code", VLLM, lo=1, nullable=True),
        Knob("enforce_eager", "bool", True, "no graph capture (quicker start, CPU)"),
        Knob("speculative_method", "str", "custom_class", "custom_class: the suite's drafter as vLLM's proposer; "
             "ngram | suffix: vLLM's own; none", choices=("custom_class", "ngram", "suffix", "none")),
        Knob("num_speculative_tokens", "int", 24, "vLLM's k, the cap on drafts after the first token (= the "
             "tree methods' max_spec_tokens)", lo=1),
        Knob("max_num_seqs", "int", 256, "vLLM's batch limit", "released code", VLLM, lo=1),
        Knob("seed", "int", 0, "vLLM's engine seed (each request also gets its own)", lo=0),
        Knob("spec_verify", "str", "auto", "who verifies drafts after the first: vllm, python (bench.core.verify), "
             "auto (python at T > 0 on CPU)", choices=("auto", "vllm", "python")),
        Knob("plain_engine_for", "list", ["baseline", "prefix"], _PLAIN),
        Knob("extra", "dict", {}, "any other vllm.LLM keyword argument"),
    ),
    "sglang": (
        Knob("device", "str", "cpu", "cpu or cuda"),
        Knob("dtype", "str", "float32", "SGLang's dtype (float32 as torch_ref's default)",
             choices=("auto", "bfloat16", "float16", "float32")),
        Knob("attention_backend", "str", None, "null: SGLang's choice (torch_native on CPU)", "released code",
             SGL, nullable=True),
        Knob("mem_fraction_static", "float", None, "memory share per engine (null: SGLang's default; 0.4 "
             "each beside an NGRAM engine)", "released code", SGL, lo=0, hi=1, open_lo=True, nullable=True),
        Knob("random_seed", "int", 0, "SGLang's sampler seed", lo=0),
        Knob("deterministic", "bool", False, "per-rollout sampling_seed (enable_deterministic_inference; GPU "
             "attention backends only)"),
        Knob("speculative_algorithm", "str", None, "null: tree methods on the suite's scheduler; NGRAM: via SGLang's n-gram trie "
             "(GPU only)",
             choices=("NGRAM",), nullable=True),
        Knob("speculative_num_draft_tokens", "int", 24, "NGRAM draft tokens per step (= the tree methods' "
             "max_spec_tokens)", lo=1),
        Knob("ngram_external_sam_budget", "int", 8, "NGRAM draft nodes from the external corpus (earlier "
             "rollouts)", lo=0),
        Knob("plain_engine_for", "list", ["baseline", "prefix"], _PLAIN),
        Knob("log_level", "str", "error", "SGLang's log level",
             choices=("debug", "info", "warning", "error", "critical")),
        Knob("extra_args", "dict", {}, "any other sglang.Engine keyword argument"),
    ),
}

_TRACE = "null: the value the trace was recorded with"
SAMPLING: tuple[Knob, ...] = (
    Knob("temperature", "float", None, f"softmax temperature, 0 = greedy ({_TRACE})", lo=0, nullable=True),
    Knob("top_p", "float", None, f"nucleus mass kept, 1 = off ({_TRACE})", lo=0, hi=1, open_lo=True,
         nullable=True),
    Knob("top_k", "int", None, f"most likely tokens kept, 0 = off ({_TRACE})", lo=0, nullable=True),
    Knob("max_new_tokens", "int", None, f"rollout length cap ({_TRACE})", lo=1, nullable=True),
    Knob("seed", "int", None, f"coupled-sampling seed ({_TRACE})", nullable=True),
    Knob("stop_token_ids", "list", None, f"stop tokens beside the checkpoint's EOS ({_TRACE})", nullable=True),
)

VERIFY: tuple[Knob, ...] = (
    Knob("rule", "str", "exact", "exact: lossless coupled sampling; ratio: SPEC-RL's lenient test (lossy); "
         "greedy: argmax", choices=("exact", "ratio", "greedy")),
    Knob("lenience", "float", 1.0, "ratio rule only: accept while U <= min(1, l p_new / p_old); 1 = none", lo=1),
)
