"""The trace group and the run's own options (conf/bench.yaml's top-level keys) declared once.

    python -m bench.harness.cli max_steps=0        # refused by EXPERIMENT's max_steps before anything is written

``TRACE`` is conf/trace/*.yaml; ``EXPERIMENT`` is every top-level key of conf/bench.yaml that is not a
config group. Checks that need the trace itself (``steps`` naming recorded steps) stay in bench.harness.config_checks.
tests/test_knobs.py compares both with the YAML files.
"""
from __future__ import annotations

from bench.knobs import Knob

GROUPS = ("trace", "engine", "method", "sampling")  # the config groups with schemas of their own

TRACE: tuple[Knob, ...] = (
    Knob("name", "str", "countdown-search", "the trace's name (a bundled one is recorded on first use)"),
    Knob("path", "str", None, "a trace directory (python -m bench.traces.importer makes one); null: the bundled "
         "trace called name", nullable=True),
    Knob("tiny", "bool", False, "record the bundled trace at the tests' tiny size"),
)

EXPERIMENT: tuple[Knob, ...] = (
    Knob("steps", "list", None, "step numbers to replay (null: every step of the trace)", nullable=True),
    Knob("max_steps", "int", None, "replay only the first N of those steps (null: all)", lo=1, nullable=True),
    Knob("run_id", "str", None, "the run folder's name (null: derived from the config, so a rerun resumes)",
         nullable=True),
    Knob("timing_repeats", "int", 1, "time each (step, method) this many times; the median repeat is kept",
         lo=1),
    Knob("interleave", "bool", False, "torch_ref: a step's methods a few iterations each in turn"),
    Knob("interleave_turn", "int", 4, "iterations of a call per turn when interleaving", lo=1),
    Knob("results_root", "str", "results/runs", "where run folders are written"),
    Knob("figures_root", "str", "results/figures", "where figures are written"),
    Knob("progress", "bool", True, "progress bars on stderr"),
    Knob("plots", "bool", True, "draw the figures after the run"),
    Knob("predict", "list", [{"hardware": "h100_sxm", "model": "qwen2.5-7b"},
                             {"hardware": "h200", "model": "llama-3.1-8b"}],
         "predicted speedups printed beside the measured ones: hardware x model_shape pairs ([]: off)"),
)

__all__ = ["EXPERIMENT", "GROUPS", "TRACE"]
