"""tail_share (bench.report.stats): the share of a step's rollout wall time with at most 8 live rows, and the
live-rows curve of the figure (bench.report.live_rows_plot), on hand-made iterations.parquet rows."""
import pandas as pd
import pytest

from bench.report.live_rows_plot import live_rows_curve
from bench.report.stats import tail_share


def _iterations(rows):
    cols = ["run_id", "method", "step", "iteration", "call", "live_rows", "forward_s", "verify_s", "drafter_s",
            "other_s"]
    return pd.DataFrame(rows, columns=cols)


def test_tail_share_counts_the_seconds_of_iterations_with_few_live_rows():
    it = _iterations([
        ("r", "baseline", 0, 0, 0, 64, 1.0, 0.5, 0.0, 0.5),   # 2 s at 64 rows (two forward calls)
        ("r", "baseline", 0, 0, 1, 64, 0.0, 0.0, 0.0, 0.0),
        ("r", "baseline", 0, 1, 0, 8, 0.5, 0.2, 0.1, 0.2),    # 1 s at 8 rows: the tail
        ("r", "baseline", 0, 2, 0, 1, 0.7, 0.1, 0.1, 0.1),    # 1 s at 1 row
        ("r", "baseline", 1, 0, 0, 9, 1.0, 0.0, 0.0, 0.0),    # step 1: no tail
        ("r", "hybrid", 0, 0, 0, 3, 1.0, 0.0, 0.0, 0.0)])
    out = tail_share(it).set_index(["method", "step"])["tail_share"]
    assert out[("baseline", 0)] == pytest.approx(0.5)
    assert out[("baseline", 1)] == 0.0 and out[("hybrid", 0)] == 1.0
    assert tail_share(it, max_rows=0).set_index(["method", "step"])["tail_share"].max() == 0.0
    assert tail_share(it.iloc[:0]).empty
    t, live = live_rows_curve(it[(it.method == "baseline") & (it.step == 0)])
    assert list(t) == [0.0, 2.0, 3.0] and list(live) == [64, 8, 1]
