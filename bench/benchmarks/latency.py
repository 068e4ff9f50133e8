"""Latency tables on this machine, and a run's rollout seconds predicted on other hardware.

    python -m bench.benchmarks latency profile --checkpoint CKPT --out table.csv        # this machine, torch_ref
    python -m bench.benchmarks latency predict RUN --table table.csv                    # through a measured table
    python -m bench.benchmarks latency predict RUN --hardware h200 --model llama-3.1-8b # through a roofline

The table's format and the pricing live in ``bench.spec.latency``; the profiling in
``bench.engines.torch.timing``; reading a run's logs in ``bench.report.prediction``.
"""
from __future__ import annotations
import argparse
from pathlib import Path
from bench.core.errors import UserError, run_main
from bench.spec.roofline import Hardware, ModelShape, _names
from bench.spec.latency import DEFAULT_CONTEXT
from bench.spec.latency import DEFAULT_QUERY
from bench.spec.latency import DEFAULT_ROWS
from bench.spec.latency import LatencyTable
from bench.spec.latency import extrapolation_note
from bench.report.prediction import predict
from bench.spec.latency import prediction_error
from bench.engines.torch.timing import profile
from bench.spec.latency import summarize_prediction


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError as exc:
        raise UserError(f"{text!r} is not a comma-separated list of integers") from exc


def appended(path: Path, new):
    """The table at ``path`` with the newly profiled shapes added (a shape timed again replaces the
    old one); refused when the two were profiled on a different model, machine, thread count or dtype."""
    import pandas as pd
    if not path.exists():
        raise UserError(f"--append: {path} does not exist; profile it first without --append")
    old = pd.read_csv(path)
    for col in ("engine", "hardware", "threads", "model", "dtype"):
        if col in old and col in new and set(old[col].astype(str)) != set(new[col].astype(str)):
            raise UserError(f"--append: {path} was profiled with {col} {sorted(set(old[col].astype(str)))}, these "
                            f"shapes with {sorted(set(new[col].astype(str)))}; write them to a table of their own")
    if "tree" in new and "tree" not in old:
        old = old.assign(tree=0)
    if "tree" in old and "tree" not in new:  # chain shapes added to a table with a tree grid
        new = new.assign(tree=0)
    keys = [c for c in ("rows", "query", "context", "tree") if c in new]
    both = pd.concat([old, new], ignore_index=True)
    return both.drop_duplicates(subset=keys, keep="last").reset_index(drop=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.benchmarks latency", description=__doc__.splitlines()[0])
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
    p.add_argument("--trees", action="store_true", help="also time every shape with tree drafts (column tree = 1): "
                   "tree drafters' passes are then priced from those")
    p.add_argument("--append", action="store_true", help="add these shapes to the table already at --out (same "
                   "model, machine, threads and dtype), e.g. one wider query column for a few wide passes")
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
            from bench.engines.torch.engine import TorchRefEngine
            ckpt = args.checkpoint
            if ckpt is None:
                from bench.traces.record.cache import ensure_trace
                from bench.traces.format import Trace
                trace = Trace.load(ensure_trace("countdown-search"))
                ckpt = trace.checkpoint(trace.step_numbers[-1])
            if args.append and not args.out.exists():  # refused before the profile, not after it
                raise UserError(f"--append: {args.out} does not exist; profile it first without --append")
            engine = TorchRefEngine(device=args.device, dtype=args.dtype, threads=args.threads)
            engine.load(ckpt)
            frame = profile(engine, _ints(args.rows), _ints(args.query), _ints(args.context), args.repeats,
                            trees=args.trees)
            if args.append:
                try:
                    frame = appended(args.out, frame)
                except UserError as exc:  # the shapes just timed are kept beside the table
                    kept = args.out.with_suffix(".new.csv")
                    frame.to_csv(kept, index=False)
                    raise UserError(f"{exc} (the shapes timed now are in {kept})") from exc
            args.out.parent.mkdir(parents=True, exist_ok=True)
            frame.to_csv(args.out, index=False)
            print(f"wrote {len(frame)} shapes to {args.out} ({frame['model'].iloc[0]}, {frame['hardware'].iloc[0]})")
        else:
            table = LatencyTable.read(args.table) if args.table else None
            hw = Hardware.named(args.hardware) if args.hardware else None
            model = ModelShape.named(args.model) if args.model else None
            per = predict(args.run, table, hw, model, args.host)
            from bench.report.collect import to_markdown
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
