"""A learned drafter's own forward passes, counted so a prediction can price them on another accelerator.

A draft model runs on the accelerator beside the policy: its passes cost there what the roofline
says, not the seconds this machine measured. Each pass is counted in bytes and FLOPs (the
roofline's ``pass_bytes_flops`` at the drafter's shape, weights in bf16 as on a GPU), whatever the
accelerator, in two classes: window passes (a row reads more than one new token: the drafter's
context, once a draft) and step passes (one token a row: each further token of a chain). The
passes of one class in one iteration share their rows and so their regime (memory- or
compute-bound), so the class's sums price exactly as one pass (``bytes_flops_seconds``).

The shape is the drafter's in the run: a draft LM's is its own, wherever it runs; an EAGLE head's is one
decoder layer of the run's policy, so a prediction for a larger target model prices a head smaller
than that model's would be (one of its layers and its LM head over the draft vocabulary a pass).

The scheduler takes the counts once an iteration (``take``) into the iteration log's
``drafter_model_*`` columns; ``bench.spec.latency.predict_iterations`` prices them through the
target's roofline in place of the measured ``drafter_model_s``.
"""
from __future__ import annotations

import time

from bench.spec.roofline import ModelShape, pass_bytes_flops

FIELDS = ("drafter_model_s", "drafter_model_passes", "drafter_window_bytes", "drafter_window_flops",
          "drafter_step_bytes", "drafter_step_flops")


class ModelPasses:
    """The counts of one drafter's passes since the last ``take``."""

    def __init__(self, shape: ModelShape, extra_weights: int = 0):
        self.shape, self.extra_weights = shape, extra_weights
        self._counts = dict.fromkeys(FIELDS, 0.0)
        self._t0 = None

    def add(self, rows: int, query_tokens: int, context_sum: int) -> None:
        """One pass of ``rows`` rows reading ``query_tokens`` new tokens in all, over ``context_sum``
        cached-plus-new tokens in all."""
        b, f = pass_bytes_flops(self.shape, query_tokens, context_sum, rows, self.extra_weights)
        kind = "window" if query_tokens > rows else "step"
        self._counts[f"drafter_{kind}_bytes"] += float(b)
        self._counts[f"drafter_{kind}_flops"] += float(f)
        self._counts["drafter_model_passes"] += 1

    def __enter__(self):
        """``with passes:`` around a draft call measures its seconds (``drafter_model_s``)."""
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._counts["drafter_model_s"] += time.perf_counter() - self._t0

    def take(self) -> dict:
        """The counts since the last take (then zero)."""
        out = self._counts
        out["drafter_model_passes"] = int(out["drafter_model_passes"])
        self._counts = dict.fromkeys(FIELDS, 0.0)
        return out


def shape_of(config, name: str) -> ModelShape:
    """The roofline's shape of a transformers config (weights priced in bf16, as a GPU runs them)."""
    return ModelShape.from_config(config.to_dict(), name=name, dtype_bytes=2)
