"""A recorded trace's statistics as a Markdown table (per quarter of the steps), from its stats.json.

    python -m bench.traces.record.summary TRACE_DIR

Columns: reward, correct share, response length mean / p50 / p90 / p99 / max, repeat fraction (same
slot, previous visit), share of each rollout's 8-grams already in its prompt's earlier rollouts,
and the checkpoint steps. Below it: the lengths of the whole trace and the targets of the long-tailed
reasoning trace (mean >= 150, p99 >= 3x p50, reward of the last quarter >= the first + 0.1, repeat
fraction <= 0.3).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _mean(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.mean(vals) if vals else None


def _f(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def summary(trace_dir: Path) -> str:
    stats = json.loads((Path(trace_dir) / "stats.json").read_text())
    rows = stats["steps"]
    k = max(1, len(rows) // 4)
    quarters = [rows[i:i + k] for i in range(0, len(rows), k)][:4]
    if len(rows) % 4 and len(quarters) == 4:
        quarters[-1] += rows[4 * k:]
    lines = ["| steps | reward | correct | length mean | p50 | p90 | p99 | max | repeat frac | 8-gram seen | checkpoints |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for q in quarters:
        ck = [r["step"] for r in q if r.get("checkpoint", True)]
        lines.append(
            f"| {q[0]['step']}-{q[-1]['step']} | {_f(_mean(q, 'reward_mean'))} | {_f(_mean(q, 'correct_frac'))} | "
            f"{_f(_mean(q, 'length_mean'), 1)} | {_f(_mean(q, 'length_p50'), 0)} | {_f(_mean(q, 'length_p90'), 0)} | "
            f"{_f(_mean(q, 'length_p99'), 0)} | {max(r.get('length_max', 0) for r in q)} | "
            f"{_f(_mean(q, 'repeat_frac'))} | {_f(_mean(q, 'ngram8_seen_frac'))} | {ck if ck else '-'} |")
    out = "\n".join(lines) + "\n"
    lengths = stats.get("lengths")
    first, last = _mean(quarters[0], "reward_mean"), _mean(quarters[-1], "reward_mean")
    repeat = _mean(rows, "repeat_frac")
    cfg = stats["config"]
    if lengths:
        out += (f"\nAll {len(rows)} steps: length mean {lengths['mean']:.1f}, p50 {lengths['p50']:.0f}, "
                f"p90 {lengths['p90']:.0f}, p99 {lengths['p99']:.0f}, max {lengths['max']} "
                f"(p99 / p50 = {lengths['p99_over_p50']:.2f}); max_new_tokens {cfg['max_new_tokens']}; "
                f"reward first quarter {first:.3f}, last quarter {last:.3f} ({last - first:+.3f}); "
                f"repeat fraction {_f(repeat)}; recorded in {stats['wall_s']:.0f} s ("
                f"{'SFT' if stats.get('sft_final_loss') is not None else 'no SFT; loading the policy'} {stats['sft_s']:.0f} s).\n")
        checks = {"mean >= 150": lengths["mean"] >= 150, "p99 >= 3x p50": lengths["p99_over_p50"] >= 3,
                  "max_new_tokens >= 512": cfg["max_new_tokens"] >= 512,
                  "reward last quarter >= first + 0.1": last >= first + 0.1,
                  "repeat fraction <= 0.3": repeat is not None and repeat <= 0.3}
        out += "Targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in checks.items()) + ".\n"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    print(summary(ap.parse_args().trace))


if __name__ == "__main__":
    main()
