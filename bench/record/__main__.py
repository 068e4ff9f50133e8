"""Record an RL trace with the bundled tiny task and policy (SFT warm start, then GRPO).

    python -m bench.record --out traces/countdown-tiny --tiny
    python -m bench.record --out traces/countdown       # the default trace, about 1.5 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

from ..trace import MANIFEST
from .grpo import RecordConfig, format_row, record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="trace directory to create")
    ap.add_argument("--tiny", action="store_true", help="the small test trace (under a minute)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1 is fastest on a shared 2-core machine, and deterministic)")
    for f in fields(RecordConfig):  # every recorder knob is a flag: --steps, --lr, --sft-steps, ...
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None)
    args = ap.parse_args(argv)
    if (args.out / MANIFEST).exists():
        sys.exit(f"{args.out} already holds a trace ({MANIFEST}); choose another --out or delete it")
    overrides = {f.name: getattr(args, f.name) for f in fields(RecordConfig)
                 if getattr(args, f.name) is not None}
    cfg = RecordConfig.tiny(**overrides) if args.tiny else RecordConfig(**overrides)
    t0 = time.perf_counter()
    record(args.out, cfg, threads=args.threads)
    stats = json.loads((args.out / "stats.json").read_text())
    print(f"\nrecorded {cfg.name!r} into {args.out} in {time.perf_counter() - t0:.1f}s "
          f"(SFT {stats['sft_s']:.1f}s, final SFT loss {stats['sft_final_loss']:.3f})")
    for row in stats["steps"]:
        print(format_row(row))


if __name__ == "__main__":
    main()
