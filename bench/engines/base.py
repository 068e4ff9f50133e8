"""The Engine protocol every inference backend implements, and the request it takes.

An engine owns the model; a drafter owns the cache of earlier rollouts; ``bench.verify`` owns the
acceptance rule. Engines never contain method logic.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from methods.base import Drafter, Rollout, RolloutKey

from ..sampling import SamplingConfig
from ..verify import VerifyConfig


@dataclass
class Request:
    """One rollout to generate: a (prompt, sample) slot of a step."""

    key: RolloutKey
    prompt_token_ids: list[int]
    step: int = 0
    run_ahead: bool = False  # tokens only feed the drafter's caches; aborted when the batch ends


# Called by an engine when its live batch has shrunk to `free` slots below its target size;
# returns run-ahead requests to admit now (possibly none).
RunAheadSource = Callable[[int], list[Request]]


class Engine(Protocol):
    name: str

    def load(self, checkpoint: Path) -> None: ...

    def rollout(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter,
                verify: VerifyConfig, run_ahead: RunAheadSource | None = None) -> list[Rollout]: ...

    def close(self) -> None: ...
