"""Record an RL trace with the bundled tiny task and policy (SFT warm start, then GRPO).

    python -m bench.traces.record --out traces/countdown-tiny --tiny
    python -m bench.traces.record --out traces/countdown       # the short trace, about 2 minutes on 1 core
    python -m bench.traces.record --out traces/countdown-search --preset search   # the long-tailed reasoning trace
    python -m bench.traces.record --out traces/smollm2 --preset smollm2 --threads 2  # GRPO on the real model
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

from bench.traces.format import MANIFEST
from bench.traces.record.grpo import RecordConfig, SearchRecordConfig, record
from bench.traces.record.smollm2 import SmolLM2RecordConfig
from bench.traces.record.step_stats import format_row

PRESETS = {"countdown": RecordConfig, "search": SearchRecordConfig, "smollm2": SmolLM2RecordConfig}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="trace directory to create")
    ap.add_argument("--tiny", action="store_true", help="the small test trace (under a minute)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1 is fastest on a shared 2-core machine, and deterministic)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="countdown",
                    help="countdown: the short task; search: Countdown by written-out search (long-tailed); "
                         "smollm2: word problems on the real model (LoRA GRPO)")
    knobs = {f.name: f for cls in PRESETS.values() for f in fields(cls)}
    for f in knobs.values():  # every recorder knob is a flag: --steps, --lr, --sft-steps, ...
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None)
    args = ap.parse_args(argv)
    if (args.out / MANIFEST).exists():
        sys.exit(f"{args.out} already holds a trace ({MANIFEST}); choose another --out or delete it")
    cls = PRESETS[args.preset]
    overrides = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name) is not None}
    unknown = [k for k in knobs if getattr(args, k) is not None and k not in overrides]
    if unknown:
        sys.exit(f"--{unknown[0].replace('_', '-')} is not a knob of --preset {args.preset}")
    cfg = cls.tiny(**overrides) if args.tiny else cls(**overrides)
    t0 = time.perf_counter()
    record(args.out, cfg, threads=args.threads)
    stats = json.loads((args.out / "stats.json").read_text())
    warm = (f"SFT {stats['sft_s']:.1f}s, final SFT loss {stats['sft_final_loss']:.3f}"
            if stats["sft_final_loss"] is not None else f"no SFT, {stats['sft_s']:.1f}s to load the policy")
    print(f"\nrecorded {cfg.name!r} into {args.out} in {time.perf_counter() - t0:.1f}s ({warm})")
    for row in stats["steps"]:
        print(format_row(row))


if __name__ == "__main__":
    main()
