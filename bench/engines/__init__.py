"""Inference engines behind one protocol; heavy engines are imported only when asked for."""
from __future__ import annotations

from bench.core.engine_protocol import Engine, Request

ENGINE_EXTRAS = {"torch_ref": None, "vllm": "vllm", "sglang": "sglang"}


def make_engine(name: str, **kwargs) -> Engine:
    """Build an engine by name; an engine whose package is missing names the extra to install."""
    if name == "torch_ref":
        from bench.engines.torch.engine import TorchRefEngine
        return TorchRefEngine(**kwargs)
    if name == "sglang":
        from bench.engines.sglang.adapter import SGLangEngine, import_sglang
        import_sglang(kwargs.get("device", "cpu"))  # fail now, with the install hint, not at load()
        return SGLangEngine(**kwargs)
    if name == "vllm":
        from bench.engines.vllm.adapter import VLLMEngine  # imports no vLLM until the engine is built
        return VLLMEngine(**kwargs)
    if name in ENGINE_EXTRAS:
        raise NotImplementedError(
            f"engine {name!r} has no adapter in this version of SpecRollout yet (planned: install it in its "
            f"own environment with pip install -e '.[{ENGINE_EXTRAS[name]}]'); use engine=torch_ref")
    raise ValueError(f"Unknown engine {name!r}; choose one of {sorted(ENGINE_EXTRAS)} (conf/engine/)")


__all__ = ["Engine", "Request", "make_engine"]
