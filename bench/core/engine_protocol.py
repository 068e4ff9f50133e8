"""The Engine protocol every inference backend implements, and the request it takes.

An engine owns the model; a drafter owns the cache of earlier rollouts; ``bench.core.verify`` owns the
acceptance rule. Engines never contain method logic.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from methods.base import Drafter, Rollout, RolloutKey

from bench.core.coupling import SamplingConfig, _signed, rollout_seed, splitmix64
from bench.core.verdicts import VerifyConfig


@dataclass
class Request:
    """One rollout to generate: a (prompt, sample) slot of a step."""

    key: RolloutKey
    prompt_token_ids: list[int]
    step: int = 0  # the step whose checkpoint generates it (for run-ahead too)
    run_ahead: bool = False  # tokens only feed the drafter's caches; aborted when the batch ends
    anticipates: int | None = None  # run-ahead only: the later step whose prompt it samples early


# Domain tag mixed into the key of run-ahead rollouts: their uniforms form a key space of their
# own, so a run-ahead sample never reuses the uniforms of the rollout it anticipates.
RUN_AHEAD_DOMAIN = 0x52554E41484541  # "RUNAHEA"


def request_key64(seed: int, request: Request) -> int:
    """The coupled-sampling key (signed int64) of a request, the same on every engine.

    A trained rollout's key is ``rollout_seed(seed, step, prompt, sample)``. A run-ahead rollout
    is keyed in its own domain: were it keyed like the rollout of the step it anticipates, it
    would draw that rollout's very uniforms and, the policy moving little in a step, copy the
    future token for token (the drafter would be fed the answer it is about to be asked for).
    """
    key = rollout_seed(seed, request.step, request.key.prompt_id, request.key.sample_idx)
    if request.run_ahead:
        key = _signed(splitmix64((key & ((1 << 64) - 1)) ^ RUN_AHEAD_DOMAIN))
    return key


# Called by an engine when its live batch has shrunk to `free` slots below its target size;
# returns run-ahead requests to admit now (possibly none).
RunAheadSource = Callable[[int], list[Request]]


class Engine(Protocol):
    name: str

    def load(self, checkpoint: Path) -> None: ...

    def rollout(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter,
                verify: VerifyConfig, run_ahead: RunAheadSource | None = None) -> list[Rollout]: ...

    def close(self) -> None: ...
