"""Coupled sampling without torch: the sampling config, the per-rollout keys and the scalar
uniform of one (key, position, stream).

Why a module of its own: the simulator, the schedulers and the methods' side of an engine use
the config and the keys but no tensor; importing them from here keeps torch, most of a
simulator process's start-up time and memory before it reads a log, out of
``python -m bench.harness.simulate``. ``bench.core.sampling`` holds the
vectorised uniforms and the processed target distributions, and re-exports everything here.
Exercised by ``pytest tests/test_sampling.py``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
STREAM_SAMPLE = 0  # the token sampled at a position (every rule)
STREAM_ACCEPT = 1  # the ratio rule's independent acceptance test


@dataclass
class SamplingConfig:
    """How rollouts are sampled; temperature 0 means greedy (argmax, lowest id on ties)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the checkpoint's EOS

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# ---------------------------------------------------------------- keys (Python ints, per rollout)

def _signed(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    """Reference splitmix64 finaliser on Python ints (unsigned 64-bit result)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def stable_hash(text: str) -> int:
    """A process-independent 64-bit hash of a string (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def rollout_seed(seed: int, step: int, prompt_id: str, sample_idx: int) -> int:
    """The signed int64 key of one rollout slot at one step; positions are mixed in later."""
    z = splitmix64(seed & MASK64)
    z = splitmix64(z ^ (step & MASK64))
    z = splitmix64(z ^ stable_hash(str(prompt_id)))
    z = splitmix64(z ^ (sample_idx & MASK64))
    return _signed(z)


def uniform_reference(key: int, position: int, stream: int = STREAM_SAMPLE) -> float:
    """Pure-Python reference of :func:`uniforms` for one (key, position, stream): test vectors."""
    z = splitmix64((key & MASK64) ^ ((position * GOLDEN) & MASK64) ^ ((stream * MIX2) & MASK64))
    return ((z >> 11) + 0.5) / float(1 << 53)
