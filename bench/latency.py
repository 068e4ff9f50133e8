"""From counts to wall clock: latency tables of forward passes, an analytic roofline, and the rollout
seconds a run's iteration log predicts on other hardware.

    python -m bench.latency profile --checkpoint CKPT --out table.csv        # this machine, torch_ref
    python -m bench.latency predict RUN --table table.csv                    # through a measured table
    python -m bench.latency predict RUN --hardware h200 --model llama-3.1-8b # through a roofline

A **latency table** holds the seconds of one forward pass of the engine's own path (slot KV cache,
4D mask, ragged block) for a grid of live rows x query tokens per row x context tokens per row, on
one engine, model, dtype and machine (named in its columns). A run's ``iterations.parquet`` holds
the shape of every forward pass it made; replaying those shapes through a table (or a roofline)
and adding the host-side seconds that were measured (drafter, verifier, bookkeeping) gives
*predicted* rollout seconds per (step, method). Predictions are always labelled as such and never
mixed with measured columns.

The roofline (``bench.roofline``) ignores kernel-launch and scheduler overheads, attention-kernel
efficiency beyond one efficiency factor per resource, tensor or pipeline parallelism, padding, and
the cost of sampling/verification on the device.
"""
from __future__ import annotations

import argparse
import bisect
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from .errors import UserError, run_main
from .roofline import Hardware, ModelShape, _names, roofline_seconds
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
        missing = [c for c in (*GRID_COLUMNS, "seconds") if c not in frame]
        if missing:
            raise UserError(f"{source}: a latency table needs the columns rows, query, context, seconds "
                            f"(missing {', '.join(missing)}); write one with python -m bench.latency profile")
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
                            f"python -m bench.latency profile --out {path}")
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

    def seconds(self, rows, query, context) -> np.ndarray:
        """Predicted seconds of passes with these shapes (array-likes of equal length)."""
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

def profile(engine, rows: Sequence[int] = DEFAULT_ROWS, query: Sequence[int] = DEFAULT_QUERY,
            context: Sequence[int] = DEFAULT_CONTEXT, repeats: int = 5, progress: bool = True,
            interleaved: bool = False) -> pd.DataFrame:
    """Time the loaded engine's forward pass over the grid; one row per grid point (median).
    ``interleaved``: the widths timed in turn (the speculation policy's table), not back to back
    (``bench.engines.torch_timing.time_forward``)."""
    from tqdm.auto import tqdm

    from .results import environment
    grid = [(r, c) for r in rows for c in context]
    env = environment()
    hardware = env["hardware"].get("gpu") or env["hardware"].get("cpu", "?")
    cfg = engine.model.config
    shape = ModelShape.from_config(cfg.to_dict(), "profiled")
    out = []
    from .engines.torch_timing import time_forward
    if not interleaved:  # untimed: the grid's first shape, once, so the engine's one-time costs (allocator,
        # kernels chosen at a first call) land on no grid point; the first point measured 1.5x its neighbours
        time_forward(engine, grid[0][0], list(query), grid[0][1], repeats)
    for r, c in tqdm(grid, desc="latency profile", disable=not progress, unit="prefill"):
        for q, times in time_forward(engine, r, list(query), c, repeats, interleaved).items():
            out.append({"rows": r, "query": q, "context": c, "seconds": float(np.median(times)),
                        "seconds_min": float(np.min(times)), "seconds_max": float(np.max(times))})
    frame = pd.DataFrame(out)
    frame["engine"] = engine.name
    frame["hardware"] = hardware
    frame["threads"] = _threads()
    frame["model"] = (f"{shape.layers}L h{shape.hidden} heads {shape.heads}/{shape.kv_heads} "
                      f"V{shape.vocab} ({shape.params / 1e6:.2f}M params)")
    frame["dtype"] = str(engine.dtype).replace("torch.", "")
    return frame


def _threads() -> int:
    import torch
    return torch.get_num_threads()


# ------------------------------------------------------------------ prediction

def predict(run_dir: str | Path, table: LatencyTable | None = None, hardware: Hardware | None = None,
            model: ModelShape | None = None, host: str = "measured") -> pd.DataFrame:
    """Predicted rollout seconds per (step, method) of one run, and predicted speedup vs its baseline.

    Through ``table`` each pass costs the table's seconds at its (rows, padded query per row,
    mean context); through the roofline (``hardware`` and ``model``) its real query tokens and
    context. ``host="measured"`` adds the drafter, verifier and bookkeeping seconds the run
    measured (host-side work a faster accelerator does not shrink); ``"none"`` leaves them out.
    """
    from .results import load_iterations, load_run
    _, _, _, steps = load_run(run_dir)
    it = load_iterations(run_dir)
    if it.empty:
        raise UserError(f"{run_dir} has no iterations.parquet rows (recorded by torch_ref from this "
                        f"version on); rerun it to predict")
    per = predict_iterations(it, table, hardware, model, host)
    per = per.merge(steps[["step", "method", "wall_s"]].rename(columns={"wall_s": "measured_wall_s"}),
                    on=["step", "method"], how="left")
    base = per[per["method"] == "baseline"].set_index("step")
    per["measured_speedup"] = per["step"].map(base["measured_wall_s"]) / per["measured_wall_s"]
    return per


def pass_seconds(it: pd.DataFrame, table: LatencyTable | None = None, hardware: Hardware | None = None,
                 model: ModelShape | None = None) -> tuple[np.ndarray, str]:
    """Each pass's predicted forward seconds and the target's label: through ``table`` at (rows,
    padded query per row, mean context), or the roofline of ``hardware`` x ``model`` at its real
    query tokens and context."""
    if table is not None:
        return (np.asarray(table.seconds(it["rows"], it["block_tokens"] / it["rows"], it["context_sum"] / it["rows"])),
                f"table {table.label}")
    return (np.asarray(roofline_seconds(hardware, model, it["query_tokens"], it["context_sum"], it["rows"])),
            f"roofline {hardware.name} x {model.name}")


def predict_iterations(it: pd.DataFrame, table: LatencyTable | None = None, hardware: Hardware | None = None,
                       model: ModelShape | None = None, host: str = "measured",
                       host_columns: Sequence[str] = ("drafter_s", "verify_s", "other_s")) -> pd.DataFrame:
    """``predict`` over an iteration log (an engine run's ``iterations.parquet`` or the simulator's,
    which is the same schedule): per (step, method) predicted forward, host and total seconds, the
    predicted speedup against the baseline of the same step, and the predicted tail share (the
    share of predicted seconds in iterations with at most ``bench.stats.TAIL_ROWS`` live rows)."""
    from .stats import TAIL_ROWS
    if (table is None) == (hardware is None or model is None):
        raise UserError("predict needs either a latency table (--table) or both --hardware and --model")
    if host not in ("measured", "none"):
        raise UserError(f"host={host!r}: choose measured or none")
    it = it[it["rows"] > 0]
    forward, label = pass_seconds(it, table, hardware, model)
    host_s = it[list(host_columns)].sum(axis=1) if host == "measured" else 0.0
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
            f"wider shapes (python -m bench.latency profile --query ... --context ...)")


def prediction_report(run_dir: Path, targets: Sequence[dict]) -> tuple[str, pd.DataFrame]:
    """The printed section 'predicted speedups' for each target {hardware, model} or {table}."""
    from .collect import to_markdown
    frames = []
    for t in targets:
        if t.get("table"):
            frames.append(predict(run_dir, table=LatencyTable.read(t["table"])))
        else:
            frames.append(predict(run_dir, hardware=Hardware.named(t["hardware"]),
                                  model=ModelShape.named(t["model"]), host=t.get("host", "measured")))
    per_step = pd.concat(frames, ignore_index=True)
    summary = summarize_prediction(per_step)
    wide = summary.pivot(index="method", columns="target", values="predicted_speedup")
    wide.columns = [f"predicted speedup · {c}" for c in wide.columns]
    measured = summary.drop_duplicates("method").set_index("method")["measured_speedup"]
    wide.insert(0, "measured speedup (this machine)", measured)
    text = ("## Predicted speedups (not measured: the run's forward-pass shapes through a roofline; "
            "host-side drafter and verifier seconds as measured here)\n\n" + to_markdown(wide.reset_index()))
    note = extrapolation_note(per_step)
    return text + (f"\n{note}" if note else ""), summary


def prediction_figure(summary: pd.DataFrame, out: Path) -> Path:
    """Bars per method: measured speedup here beside each predicted target (labelled predicted)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    methods = [m for m in summary["method"].drop_duplicates() if m != "baseline"]
    targets = list(summary["target"].drop_duplicates())
    measured = summary.drop_duplicates("method").set_index("method")["measured_speedup"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(methods) + 2), 4.6))
    width = 0.8 / (1 + len(targets))
    x = np.arange(len(methods))
    ax.bar(x, [measured[m] for m in methods], width, label="measured (this machine)", color="0.3")
    for i, t in enumerate(targets):
        vals = summary[summary["target"] == t].set_index("method")["predicted_speedup"]
        ax.bar(x + (i + 1) * width, [vals.get(m, np.nan) for m in methods], width,
               label=f"predicted: {t}", hatch="//", alpha=0.8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x + width * len(targets) / 2, methods, rotation=30, ha="right")
    ax.set_ylabel("rollout speedup over baseline")
    ax.set_title("Measured here vs predicted on GPUs (predicted bars are not measurements)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=1 + len(targets), frameon=False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


# ------------------------------------------------------------------ command line

def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError as exc:
        raise UserError(f"{text!r} is not a comma-separated list of integers") from exc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("profile", help="time forward passes over a grid on this machine (torch_ref)")
    p.add_argument("--checkpoint", help="HF checkpoint dir (default: the last checkpoint of the main job's trace, countdown-search)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)))
    p.add_argument("--query", default=",".join(map(str, DEFAULT_QUERY)))
    p.add_argument("--context", default=",".join(map(str, DEFAULT_CONTEXT)))
    p.add_argument("--repeats", type=int, default=5)
    q = sub.add_parser("predict", help="predicted rollout seconds of a run on a table or a roofline")
    q.add_argument("run", type=Path)
    q.add_argument("--table", type=Path)
    q.add_argument("--hardware", help=f"one of {', '.join(_names('hardware'))}")
    q.add_argument("--model", help=f"one of {', '.join(_names('model_shape'))}, or an HF config.json")
    q.add_argument("--host", default="measured", choices=["measured", "none"])
    q.add_argument("--out", type=Path, help="write the per-step predictions as CSV")
    args = ap.parse_args(argv)
    run_main(lambda: _run(args))


def _run(args: argparse.Namespace) -> None:
    if True:
        if args.cmd == "profile":
            from .engines.torch_ref import TorchRefEngine
            ckpt = args.checkpoint
            if ckpt is None:
                from .record import ensure_trace
                from .trace import Trace
                trace = Trace.load(ensure_trace("countdown-search"))
                ckpt = trace.checkpoint(trace.step_numbers[-1])
            engine = TorchRefEngine(device=args.device, dtype=args.dtype, threads=args.threads)
            engine.load(ckpt)
            frame = profile(engine, _ints(args.rows), _ints(args.query), _ints(args.context), args.repeats)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            frame.to_csv(args.out, index=False)
            print(f"wrote {len(frame)} shapes to {args.out} ({frame['model'].iloc[0]}, {frame['hardware'].iloc[0]})")
        else:
            table = LatencyTable.read(args.table) if args.table else None
            hw = Hardware.named(args.hardware) if args.hardware else None
            model = ModelShape.named(args.model) if args.model else None
            per = predict(args.run, table, hw, model, args.host)
            from .collect import to_markdown
            summary = summarize_prediction(per)
            print(f"PREDICTED ({per['target'].iloc[0]}), measured beside it:\n")
            print(to_markdown(summary.drop(columns=["target"])))
            print(f"median |predicted - measured| / measured speedup: {prediction_error(summary):.3f}")
            note = extrapolation_note(per)
            if note:
                print(note)
            if args.out:
                per.to_csv(args.out, index=False)
                print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
