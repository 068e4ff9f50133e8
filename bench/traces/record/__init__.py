"""The bundled RL trace recorder: a tiny verifiable task, a char tokenizer, a tiny policy, SFT, GRPO.

    python -m bench.traces.record --out DIR [--tiny]
"""
from __future__ import annotations


def ensure_trace(name_or_dir, tiny: bool = False, progress: bool = True):
    """Path of a complete trace, recorded into the cache first if absent (see ``cache.py``)."""
    from bench.traces.record.cache import ensure_trace as _ensure
    return _ensure(name_or_dir, tiny=tiny, progress=progress)


__all__ = ["ensure_trace"]
