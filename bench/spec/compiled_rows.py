"""The one loop's per-row work compiled: the simulator's recorded verdicts and the scheduler's
settle of a pass, in ``bench/spec/_rows.c``.

    python -m pytest tests/test_compiled_rows.py -q     # C against the Python reference, row by row

Why: with the drafters' walks compiled (``methods/suffix/_compiled.c``), what is left of the
simulator's time is the loop's own Python around every row of every pass: building a verdict from
the recorded tokens, cutting it, counting it and appending it to the row, about half the
baseline's seconds. The C functions do the same steps in the same order on the same Python
objects; the Python functions (``bench.spec.recorded.recorded_verdicts_python``,
``bench.spec.scheduler.Scheduler._settle_all_python``) stay the reference and run wherever the
extension is not built, and where the scheduler shows the policy what was accepted
(``throughput_optimal``: its record call stays in Python).

Built by ``pip install -e .`` where a C compiler is at hand (``setup.py``, optional like the
suffix automaton's).
"""
from __future__ import annotations

try:
    from bench.spec._rows import recorded_verdicts as compiled_recorded_verdicts, settle_rows as compiled_settle_rows
except ImportError as exc:  # no compiler at install time: the Python reference runs
    compiled_recorded_verdicts = compiled_settle_rows = None
    if "cannot import name" in str(exc):  # the module loads: a build older than this code
        import warnings
        warnings.warn(f"bench.spec._rows is an older build ({exc}); the loop's row work runs in Python until "
                      f"it is rebuilt: pip install -e . (or python setup.py build_ext --inplace)")


def compiled_rows_available() -> bool:
    return compiled_settle_rows is not None
