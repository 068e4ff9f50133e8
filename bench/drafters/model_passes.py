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
    """The counts of one drafter's passes since the last ``take``: ``add`` only notes a pass's shape (it
    runs inside the drafter's timed propose), ``take`` counts their bytes and FLOPs, one array call a class."""

    def __init__(self, shape: ModelShape, extra_weights: int = 0):
        self.shape, self.extra_weights = shape, extra_weights
        self._shapes: dict[str, list[tuple[int, int, int]]] = {"window": [], "step": []}
        self._seconds = 0.0
        self._t0 = 0.0

    def add(self, rows: int, query_tokens: int, context_sum: int) -> None:
        """One pass of ``rows`` rows reading ``query_tokens`` new tokens in all, over ``context_sum``
        cached-plus-new tokens in all."""
        self._shapes["window" if query_tokens > rows else "step"].append((rows, query_tokens, context_sum))

    def __enter__(self):
        """``with passes:`` around a draft call measures its seconds (``drafter_model_s``)."""
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._seconds += time.perf_counter() - self._t0

    def take(self) -> dict:
        """The counts since the last take (``FIELDS``), then zero."""
        out = {"drafter_model_s": self._seconds,
               "drafter_model_passes": sum(len(v) for v in self._shapes.values())}
        for kind, shapes in self._shapes.items():
            b = f = 0.0
            if shapes:
                rows, query, context = zip(*shapes)
                b, f = (float(x.sum()) for x in pass_bytes_flops(self.shape, query, context, rows, self.extra_weights))
            out[f"drafter_{kind}_bytes"], out[f"drafter_{kind}_flops"] = b, f
        self._shapes, self._seconds = {"window": [], "step": []}, 0.0
        return {k: out[k] for k in FIELDS}


def shape_of(config, name: str) -> ModelShape:
    """The roofline's shape of a transformers config (weights priced in bf16, as a GPU runs them)."""
    return ModelShape.from_config(config.to_dict(), name=name, dtype_bytes=2)
