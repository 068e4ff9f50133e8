"""The no-speculation baseline: every token costs one forward pass.

    python -m bench.harness.cli method=baseline
"""
from __future__ import annotations

from methods.base import NullDrafter


class Baseline(NullDrafter):
    """Proposes nothing. Example: ``propose(key, [5, 7], budget=8) -> Draft([])``."""

    name = "baseline"
