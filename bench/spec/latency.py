"""From counts to seconds: latency tables of forward passes, and the rollout seconds an iteration log
predicts through a table or an analytic roofline.

A **latency table** holds the seconds of one forward pass of the engine's own path (slot KV cache,
4D mask, ragged block) for a grid of live rows x query tokens per row x context tokens per row, on
one engine, model, dtype and machine (named in its columns); ``python -m bench.benchmarks latency
profile`` measures one. An iteration log (an engine run's ``iterations.parquet`` or the simulator's,
the same schedule) holds the shape of every forward pass; pricing those shapes and adding the
host-side seconds that were measured gives *predicted* rollout seconds per (step, method).
Predictions are always labelled as such and never mixed with measured columns.

The roofline (``bench.spec.roofline``) ignores kernel-launch and scheduler overheads, attention-kernel
efficiency beyond one efficiency factor per resource, tensor or pipeline parallelism, padding, and
the cost of sampling/verification on the device.
"""
from __future__ import annotations

import bisect
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from bench.core.errors import UserError
from bench.spec.roofline import Hardware, ModelShape, bytes_flops_seconds, roofline_seconds

TAIL_ROWS = 8  # "few live rows": the tail of a step, where speculation is said to pay
GRID_COLUMNS = ("rows", "query", "context")
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_QUERY = (1, 2, 3, 5, 9, 17, 25)
DEFAULT_CONTEXT = (32, 128, 512)


# ------------------------------------------------------------------ latency tables

class LatencyTable:
    """Seconds of one forward pass by (live rows, query tokens per row, context tokens per row).

    Looked up by multilinear interpolation of log-seconds over log-coordinates; outside the grid
    the nearest two grid points are extrapolated linearly (in log space), so a pass of 256 rows on
    a table that stops at 128 still costs more than one of 128.
    """

    def __init__(self, frame: pd.DataFrame, source: str = "table"):
        self.trees: LatencyTable | None = None  # tree blocks' own grid, where the profile timed them
        if "tree" in frame and frame["tree"].astype(bool).any():
            tree = frame["tree"].astype(bool)
            self.trees = LatencyTable(frame[tree].drop(columns=["tree"]), f"{source} (tree blocks)")
            frame = frame[~tree].drop(columns=["tree"])
        missing = [c for c in (*GRID_COLUMNS, "seconds") if c not in frame]
        if missing:
            raise UserError(f"{source}: a latency table needs the columns rows, query, context, seconds "
                            f"(missing {', '.join(missing)}); write one with python -m bench.benchmarks latency profile")
        self.frame = frame.reset_index(drop=True)
        self.source = source
        self.axes = [np.array(sorted(set(frame[c].astype(float)))) for c in GRID_COLUMNS]
        grid = frame.groupby(list(GRID_COLUMNS))["seconds"].median()
        want = pd.MultiIndex.from_product([a.tolist() for a in self.axes], names=GRID_COLUMNS)
        values = grid.reindex(want)
        if values.isna().any() or (values <= 0).any():
            holes = [tuple(i) for i, v in values.items() if not v > 0][:3]
            raise UserError(f"{source}: the latency table is not a full grid of positive seconds "
                            f"(for example {holes}); profile the whole grid")
        self.log_seconds = np.log(values.to_numpy().reshape([len(a) for a in self.axes]))

    @classmethod
    def read(cls, path: str | Path) -> "LatencyTable":
        path = Path(path)
        if not path.exists():
            raise UserError(f"latency table {path} does not exist; write one with "
                            f"python -m bench.benchmarks latency profile --out {path}")
        try:
            frame = pd.read_csv(path)
        except Exception as exc:
            raise UserError(f"{path} is not a latency table CSV ({exc})") from exc
        return cls(frame, str(path))

    @property
    def label(self) -> str:
        first = self.frame.iloc[0]
        parts = [str(first[c]) for c in ("engine", "hardware", "model", "dtype") if c in self.frame]
        return " / ".join(parts) or self.source

    def seconds(self, rows, query, context, tree=None) -> np.ndarray:
        """Predicted seconds of passes with these shapes (array-likes of equal length). ``tree``
        (per pass, optional): the pass's block holds a tree draft, priced from the tree grid where
        the table has one (``profile --trees``): its ancestor mask is host work the chain grid misses."""
        if tree is not None and self.trees is not None:
            tree = np.asarray(tree, dtype=bool)
            out = self.seconds(rows, query, context)
            if tree.any():
                pick = lambda v: np.asarray(v, dtype=float)[tree]
                out[tree] = self.trees.seconds(pick(rows), pick(query), pick(context))
            return out
        points = [np.log(np.maximum(np.asarray(v, dtype=float), 1.0)) for v in (rows, query, context)]
        out = np.zeros(len(points[0]))
        corners = [_bracket(p, np.log(a)) for p, a in zip(points, self.axes)]
        for bits in range(8):
            weight = np.ones_like(out)
            index = []
            for axis, (lo, frac) in enumerate(corners):
                hi = (bits >> axis) & 1
                weight = weight * (frac if hi else 1.0 - frac)
                index.append(lo + hi)
            out += weight * self.log_seconds[tuple(index)]
        return np.exp(out)

    def scaled(self, factor: float) -> "LatencyTable":
        """The same table with every pass ``factor`` times dearer (its tree grid too): a table timed
        in a tight loop, levelled to what the passes of a run measured (``bench.harness.sim_validate``)."""
        if not factor > 0:
            raise UserError(f"a latency table can only be scaled by a positive factor, got {factor}")
        out = LatencyTable(self.frame.assign(seconds=self.frame["seconds"] * factor), self.source)
        out.trees = self.trees.scaled(factor) if self.trees is not None else None
        return out

    def beyond(self, rows, query, context, factor: float = 1.5) -> np.ndarray:
        """Which shapes lie more than ``factor`` past the grid's largest point on some axis: their
        seconds are extrapolated (a 640-token first draft on a table that stops at 25 query tokens
        was priced 13x what it measured, results/LOG.md)."""
        out = np.zeros(len(np.asarray(rows)), dtype=bool)
        for values, axis in zip((rows, query, context), self.axes):
            out |= np.asarray(values, dtype=float) > factor * float(axis[-1])
        return out

    def query_seconds(self, rows: float, queries: Sequence[float], context: float) -> list[float]:
        """``seconds`` for one (rows, context) and many query widths: the same numbers in a few
        scalar steps (the speculation policy asks this twice per engine iteration)."""
        if not hasattr(self, "_log_axes"):
            self._log_axes = [np.log(a).tolist() for a in self.axes]
            self._ls = self.log_seconds.tolist()
        (rx, qx, cx), ls = self._log_axes, self._ls
        r_lo, r_f = _bracket1(math.log(max(float(rows), 1.0)), rx)
        c_lo, c_f = _bracket1(math.log(max(float(context), 1.0)), cx)
        r_hi, c_hi = min(r_lo + 1, len(rx) - 1), min(c_lo + 1, len(cx) - 1)
        a, b, c, d = ls[r_lo], ls[r_hi], (1 - r_f) * (1 - c_f), (1 - r_f) * c_f
        e, f = r_f * (1 - c_f), r_f * c_f
        along = [c * a[j][c_lo] + d * a[j][c_hi] + e * b[j][c_lo] + f * b[j][c_hi] for j in range(len(qx))]
        out = []
        for q in queries:
            lo, frac = _bracket1(math.log(max(float(q), 1.0)), qx)
            hi = min(lo + 1, len(qx) - 1)
            out.append(math.exp(along[lo] + frac * (along[hi] - along[lo])))
        return out


def _bracket1(x: float, axis: list[float]) -> tuple[int, float]:
    """``_bracket`` of one value."""
    if len(axis) == 1:
        return 0, 0.0
    lo = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return lo, (x - axis[lo]) / (axis[lo + 1] - axis[lo])


def _bracket(x: np.ndarray, axis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower grid index and fractional position of each x on a sorted axis (fractions outside
    [0, 1] extrapolate from the outermost two points; one-point axes give index 0, fraction 0)."""
    if len(axis) == 1:
        return np.zeros(len(x), dtype=int), np.zeros(len(x))
    lo = np.clip(np.searchsorted(axis, x, side="right") - 1, 0, len(axis) - 2)
    return lo, (x - axis[lo]) / (axis[lo + 1] - axis[lo])


# ------------------------------------------------------------------ profiling


# ------------------------------------------------------------------ prediction


def pass_seconds(it: pd.DataFrame, table: LatencyTable | None = None, hardware: Hardware | None = None,
                 model: ModelShape | None = None) -> tuple[np.ndarray, str]:
    """Each pass's predicted forward seconds and the target's label: through ``table`` at (rows,
    padded query per row, mean context), or the roofline of ``hardware`` x ``model`` at its real
    query tokens and context."""
    if table is not None:
        tree = it["tree_block"].fillna(False).astype(bool) if "tree_block" in it else None
        return (np.asarray(table.seconds(it["rows"], it["block_tokens"] / it["rows"], it["context_sum"] / it["rows"],
                                         tree)), f"table {table.label}")
    return (np.asarray(roofline_seconds(hardware, model, it["query_tokens"], it["context_sum"], it["rows"])),
            f"roofline {hardware.name} x {model.name}")


def drafter_model_seconds(it: pd.DataFrame, hardware: Hardware) -> tuple[np.ndarray, np.ndarray]:
    """(measured, predicted on ``hardware``) seconds of a learned drafter's own forward passes per
    iteration-log row (its ``drafter_model_*`` columns, ``bench.drafters.model_passes``; zeros where
    a drafter runs no model or the log predates the columns): each class of passes (window, step)
    of an iteration priced as one pass of its bytes and FLOPs, plus the per-pass overhead."""
    def col(name):
        return it[name].fillna(0).to_numpy(dtype=float) if name in it else np.zeros(len(it))
    passes = col("drafter_model_passes")
    priced = (bytes_flops_seconds(hardware, col("drafter_window_bytes"), col("drafter_window_flops"), 0)
              + bytes_flops_seconds(hardware, col("drafter_step_bytes"), col("drafter_step_flops"), 0)
              + hardware.overhead_s * passes)
    return col("drafter_model_s"), np.where(passes > 0, priced, 0.0)


def predict_iterations(it: pd.DataFrame, table: LatencyTable | None = None, hardware: Hardware | None = None,
                       model: ModelShape | None = None, host: str = "measured",
                       host_columns: Sequence[str] = ("drafter_s", "verify_s", "other_s")) -> pd.DataFrame:
    """``predict`` over an iteration log (an engine run's ``iterations.parquet`` or the simulator's,
    which is the same schedule): per (step, method) predicted forward, host and total seconds, the
    predicted speedup against the baseline of the same step, and the predicted tail share (the
    share of predicted seconds in iterations with at most ``TAIL_ROWS`` live rows). Through a
    roofline, a learned drafter's own forward passes are forward seconds on the target too
    (``drafter_model_seconds``), taken out of the host seconds measured here."""
    if (table is None) == (hardware is None or model is None):
        raise UserError("predict needs either a latency table (--table) or both --hardware and --model")
    if host not in ("measured", "none"):
        raise UserError(f"host={host!r}: choose measured or none")
    it = it[it["rows"] > 0]
    forward, label = pass_seconds(it, table, hardware, model)
    host_s = it[list(host_columns)].sum(axis=1) if host == "measured" else 0.0
    if table is None:  # a learned drafter's passes run on the target accelerator too: its roofline, not this CPU
        measured, priced = drafter_model_seconds(it, hardware)
        forward = forward + priced
        if host == "measured" and "drafter_s" in host_columns:
            host_s = host_s - np.minimum(measured, it["drafter_s"].to_numpy(dtype=float))  # 0 on a virtual clock
    label += "" if host == "measured" else ", forward passes only"
    it = it.assign(predicted_forward_s=forward, predicted_host_s=host_s, predicted_s=forward + host_s)
    beyond = table.beyond(it["rows"], it["block_tokens"] / it["rows"], it["context_sum"] / it["rows"]) \
        if table is not None else np.zeros(len(it), dtype=bool)
    it = it.assign(extrapolated_s=np.where(beyond, forward, 0.0))
    it = it.assign(predicted_tail_s=it["predicted_s"].where(it["live_rows"] <= TAIL_ROWS, 0.0))
    per = it.groupby(["step", "method"], as_index=False)[
        ["predicted_forward_s", "predicted_host_s", "predicted_s", "predicted_tail_s", "extrapolated_s"]].sum()
    per["predicted_tail_share"] = per["predicted_tail_s"] / per["predicted_s"]
    per["extrapolated_share"] = per["extrapolated_s"] / per["predicted_forward_s"]  # priced off the table's grid
    per = per.drop(columns=["predicted_tail_s", "extrapolated_s"])
    base = per[per["method"] == "baseline"].set_index("step")
    per["predicted_speedup"] = per["step"].map(base["predicted_s"]) / per["predicted_s"]
    per.insert(0, "target", label)
    return per


def summarize_prediction(per_step: pd.DataFrame) -> pd.DataFrame:
    """One row per method: predicted and measured seconds per step and speedups (ratios of means)."""
    g = per_step.groupby(["target", "method"], as_index=False)[["predicted_s", "measured_wall_s"]].mean()
    base = g[g["method"] == "baseline"].set_index("target")
    g["predicted_speedup"] = g["target"].map(base["predicted_s"]) / g["predicted_s"]
    g["measured_speedup"] = g["target"].map(base["measured_wall_s"]) / g["measured_wall_s"]
    return g


def prediction_error(summary: pd.DataFrame) -> float:
    """Median absolute relative error of the predicted speedup against the measured one."""
    rows = summary[summary["method"] != "baseline"]
    err = (rows["predicted_speedup"] - rows["measured_speedup"]).abs() / rows["measured_speedup"]
    return float(err.median()) if len(err) else math.nan


def extrapolation_note(per_step: pd.DataFrame, limit: float = 0.1) -> str:
    """A warning line when more than ``limit`` of some method's predicted forward seconds were priced
    off the table's grid ('' otherwise)."""
    if "extrapolated_share" not in per_step:
        return ""
    share = per_step.groupby("method")["extrapolated_share"].mean()
    bad = share[share > limit]
    if bad.empty:
        return ""
    worst = ", ".join(f"{m} {v:.0%}" for m, v in bad.sort_values(ascending=False).items())
    return (f"warning: forward seconds priced beyond the latency table's grid (extrapolated): {worst}; profile "
            f"wider shapes (python -m bench.benchmarks latency profile --query ... --context ...)")


# ------------------------------------------------------------------ command line

