"""A finished run's predicted rollout seconds: its iteration log priced through a latency table or a
roofline (``bench.spec.latency``), set beside the wall seconds it measured; the printed section
and the figure of predicted speedups the main job shows."""
from __future__ import annotations
from pathlib import Path
from typing import Sequence
import numpy as np
import pandas as pd
from bench.core.errors import UserError
from bench.spec.roofline import Hardware, ModelShape
from bench.spec.latency import LatencyTable
from bench.spec.latency import extrapolation_note
from bench.spec.latency import predict_iterations
from bench.spec.latency import summarize_prediction


def predict(run_dir: str | Path, table: LatencyTable | None = None, hardware: Hardware | None = None,
            model: ModelShape | None = None, host: str = "measured") -> pd.DataFrame:
    """Predicted rollout seconds per (step, method) of one run, and predicted speedup vs its baseline.

    Through ``table`` each pass costs the table's seconds at its (rows, padded query per row,
    mean context); through the roofline (``hardware`` and ``model``) its real query tokens and
    context. ``host="measured"`` adds the drafter, verifier and bookkeeping seconds the run
    measured (host-side work a faster accelerator does not shrink), less a learned drafter's own
    forward passes, which the roofline prices on the target (``drafter_model_seconds``); ``"none"``
    leaves them out.
    """
    from bench.report.results import load_iterations, load_run
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


def prediction_report(run_dir: Path, targets: Sequence[dict]) -> tuple[str, pd.DataFrame]:
    """The printed section 'predicted speedups' for each target {hardware, model} or {table}."""
    from bench.report.collect import to_markdown
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
            "a learned drafter's passes through the same roofline; host-side drafter and verifier seconds as "
            "measured here)\n\n" + to_markdown(wide.reset_index()))
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
