"""The simulator at real size (vocabulary 151,936, rollouts of up to 4,096 tokens), each run in its
own process: wall seconds, peak RSS, the seconds of each part and each method's tokens per second.

    python -m bench.benchmarks simulate-scale [--methods ...] [--probe none]          # 8 steps x 128 rollouts
    python -m bench.benchmarks simulate-scale --size one-step --jobs 2 --probe none    # 1 step x 1,024 rollouts
    python -m bench.benchmarks simulate-scale --size ten-step --jobs 2 --probe none    # 10 steps x 1,024 rollouts

``--size`` picks the log: ``default`` (the simulator's own scale check), ``one-step`` (a one-step
dump of 1,024 rollouts) and ``ten-step`` (a real run's log: 10 steps x 1,024 rollouts of up to
4,096 tokens), the two sizes "your run, predicted" sets targets for; on those two the methods
default to ``copying`` (every simulable method but the learned drafters, which run a model).
"""
from __future__ import annotations
import tempfile
import time
from pathlib import Path
from bench.benchmarks.helpers import parser
from bench.benchmarks.helpers import print_rows
from bench.benchmarks.helpers import run_measured


SCALE_METHODS = ("baseline", "prefix_reuse_exact", "future_oracle")
# name: (steps, prompts, samples a prompt) of the synthetic log, methods simulated together by default
SIZES = {"default": ((8, 16, 8), SCALE_METHODS),
         "one-step": ((1, 128, 8), ("copying",)),
         "ten-step": ((10, 128, 8), ("copying",))}


def _sim_parts(stdout: str) -> dict[str, float]:
    """The per-part seconds of bench.harness.simulate's last line ("simulated ... (part 1.2s, ...)")."""
    import re
    line = next((ln for ln in stdout.splitlines() if ln.startswith("simulated ")), "")
    inner = line[line.find("(") + 1:line.rfind(")")]
    return {k: float(v) for k, v in re.findall(r"((?:cache oracle \[[^\]]*\])|[^\s,][^\s]*) ([\d.]+)s", inner)}


def _cache_oracles(log_dir: str) -> None:
    """Every distinct cache oracle of the simulable methods on a log, alone: seconds and tokens per step."""
    from bench.harness.sim_cache_oracle import oracle_passes
    from bench.harness.sim_inputs import load_input
    from bench.harness.sim_methods import FUTURE_ORACLE, build_drafter, method_config, simulable_methods
    from bench.harness.sim_replay import _engine_capped_bound
    steps, prompts, _ = load_input(log_dir)
    max_new = max(len(t) for df in steps.values() for t in df["token_ids"])
    tokens = sum(len(t) for df in steps.values() for t in df["token_ids"])
    bounds: dict = {}
    for m in simulable_methods():
        if m != FUTURE_ORACLE:
            bounds.setdefault(_engine_capped_bound(build_drafter(m, method_config(m)), max_new), []).append(m)
    parts = []
    for b, names in bounds.items():
        t = time.perf_counter()
        passes = oracle_passes(steps, max_new, b.in_flight, b.budget, b.scope, prompts)
        parts.append(f"cache oracle [{b.label()}] {time.perf_counter() - t:.1f}s")
        print(f"{b.label()} ({', '.join(names)}): {tokens / sum(passes.values()):.3f} tokens/step")
    print(f"simulated 0 methods in 0s ({', '.join(parts)})")


def simulate_scale(methods=SCALE_METHODS, probe=None, steps: int = 8, prompts: int = 16, samples: int = 8,
                   max_len: int = 4096, probe_prompts: int = 0, timeout: float = 600.0, jobs: int = 1) -> list[dict]:
    """``python -m bench.harness.simulate`` on a synthetic log of steps x (prompts x samples) rollouts of at
    most ``max_len`` tokens (``bench.harness.sim_synthetic.synthetic_log``: vocabulary 151,936, per-prompt
    templates that rollouts copy with edits, long-tailed lengths), each run in its own process:
    wall seconds and peak RSS of the whole command, and the seconds of each part (every method's
    replay, every cache oracle) and each method's tokens per second. First ``methods`` together on
    the whole log (``jobs`` processes; ``copying`` and ``all`` as ``--method`` reads them); then each ``probe``
    method (default: every other simulable method) alone on the whole log, or with
    ``probe_prompts`` on the log cut to that many prompts (every step, so each prompt's cache is
    as large as in the whole log), its time scaled by the token ratio as an estimate. Last, the oracle's structure for
    one rollout: suffix automaton states against the nodes of the old oracle's depth-max_len trie.
    """
    import json
    import sys
    with tempfile.TemporaryDirectory() as tmp:
        cut = probe_prompts if probe_prompts and probe_prompts < prompts else 0
        made = run_measured([sys.executable, "-c", "import sys; from bench.benchmarks.simulate_scale import _write_logs; "
                             "_write_logs(*sys.argv[1:])", tmp, *map(str, (steps, prompts, samples, max_len, cut))],
                            timeout)
        if made["status"]:
            raise RuntimeError(f"writing the synthetic log failed: {made['error']}")
        tokens, cut_tokens = json.loads(made["stdout"].splitlines()[-1])
        full = Path(tmp) / "full"
        rows = _together_rows(full, methods, tokens, made["wall_s"], timeout, jobs)
        if cut:
            small, where = Path(tmp) / "cut", f"alone, {probe_prompts} of {prompts} prompts"
        else:  # each probe method alone on the whole log
            cut_tokens, small, where = tokens, full, "alone, whole log"
        rows += _probe_rows(small, methods, probe, where, tokens, cut_tokens, timeout)
    return rows + _structure_rows(max_len)


def _write_logs(tmp: str, steps: str, prompts: str, samples: str, max_len: str, cut: str) -> None:
    """The synthetic log under ``tmp``/full (and, with ``cut`` > 0, the log cut to that many prompts
    under ``tmp``/cut); prints [tokens, tokens of the cut]. Run in a child process: a command's peak
    RSS as this benchmark reads it (``ru_maxrss`` through ``wait4``) starts from its parent's peak,
    and the log in memory would be that peak."""
    import json
    from bench.harness.sim_synthetic import synthetic_log, write_log
    log, _ = synthetic_log(steps=int(steps), prompts=int(prompts), samples=int(samples), max_len=int(max_len))
    tokens = sum(len(x) for df in log.values() for x in df["token_ids"])
    write_log(log, Path(tmp) / "full")
    cut_tokens = 0
    if int(cut):
        keep = {f"p{i}" for i in range(int(cut))}
        small = {s: df[df["prompt_id"].isin(keep)].reset_index(drop=True) for s, df in log.items()}
        cut_tokens = sum(len(x) for df in small.values() for x in df["token_ids"])
        write_log(small, Path(tmp) / "cut")
    print(json.dumps([tokens, cut_tokens]))


def _parts_text(stdout: str) -> str:
    return "; ".join(f"{k} {v:.1f}s" for k, v in _sim_parts(stdout).items())


def _together_rows(full: Path, methods, tokens: int, gen_s: float, timeout: float, jobs: int = 1) -> list[dict]:
    """``methods`` simulated together on the whole log (``jobs`` processes), one row per method with its
    tokens per second, then every distinct cache oracle alone."""
    import sys
    cmd = [sys.executable, "-m", "bench.harness.simulate", str(full), *[a for m in methods for a in ("--method", m)],
           "--jobs", str(jobs)]
    r = run_measured(cmd, timeout)
    print(f"$ python -m bench.harness.simulate LOG {' '.join(cmd[4:])}   (log generated and written in {gen_s:.1f}s)")
    print(r["stdout"])
    rows = [{"run": f"together, whole log, {jobs} process{'es' if jobs > 1 else ''}", "methods": ",".join(methods),
             "tokens": tokens, "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"], "status": r["status"],
             "parts": _parts_text(r["stdout"]) if not r["status"] else f"failed: {r['error']}"}]
    for name, seconds in _sim_parts(r["stdout"]).items():
        if not name.startswith("cache oracle"):
            rows.append({"run": "  its part", "methods": name, "tokens": tokens, "wall_s": seconds,
                         "peak_rss_mb": float("nan"), "status": r["status"],
                         "parts": f"{tokens / seconds / 1e3:.0f}k tokens/s" if seconds else "under 0.005 s: too fast to rate"})
    r = run_measured([sys.executable, "-c", "import sys; from bench.benchmarks.simulate_scale import _cache_oracles; "
                       "_cache_oracles(sys.argv[1])", str(full)], timeout)
    print("every distinct cache oracle alone, whole log:\n" + r["stdout"])
    rows.append({"run": "cache oracles alone, whole log", "methods": "(of every simulable method)",
                 "tokens": tokens, "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"], "status": r["status"],
                 "parts": _parts_text(r["stdout"])})
    return rows


def _probe_rows(small: Path, methods, probe, where: str, tokens: int, cut_tokens: int, timeout: float) -> list[dict]:
    """The imports alone, then each probe method alone on ``small`` (the whole log, or a cut of it
    whose seconds and memory are scaled by the token ratio as an estimate)."""
    import sys
    from bench.harness.sim_methods import expand_methods, simulable_methods
    named = set(expand_methods(methods))
    probe = [m for m in simulable_methods() if m not in named] if probe is None else list(probe)
    base = run_measured([sys.executable, "-c", "import bench.harness.simulate"], timeout)
    rows = [{"run": "imports only", "methods": "", "tokens": 0, "wall_s": base["wall_s"],
             "peak_rss_mb": base["peak_rss_mb"], "status": base["status"], "parts": ""}]
    ratio = tokens / cut_tokens
    for m in probe:
        r = run_measured([sys.executable, "-m", "bench.harness.simulate", str(small), "--method", m], timeout)
        parts = _sim_parts(r["stdout"])
        own = parts.get(m, float("nan"))
        oracle = sum(v for k, v in parts.items() if k.startswith("cache oracle"))
        rss = base["peak_rss_mb"] + (r["peak_rss_mb"] - base["peak_rss_mb"]) * ratio
        if r["status"]:
            rows.append({"run": where, "methods": m,
                         "tokens": cut_tokens, "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"],
                         "status": r["status"], "parts": f"failed: {r['error']}"})
            continue
        rows.append({"run": where, "methods": m, "tokens": cut_tokens,
                     "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"], "status": r["status"],
                     "parts": (f"{m} {own:.1f}s ({1e6 * own / cut_tokens:.0f} us/token); cache oracle {oracle:.1f}s"
                               + (f"; whole log x{ratio:.1f}: ~{own * ratio:.0f}s, ~{rss:.0f} MB" if ratio > 1 else ""))})
    return rows


def _structure_rows(max_len: int) -> list[dict]:
    """The oracle's structure for one rollout of random tokens: suffix automaton states against the
    drafters' index and the tries (the reference at depth 64, the old oracle's at depth max_len)."""
    import random

    from methods.oracle import SuffixAutomaton
    from methods.suffix.index import SuffixIndex
    from methods.suffix.tree import SuffixTrie
    rng = random.Random(0)
    text = [rng.randrange(151_936) for _ in range(max_len)]
    rows = []
    for n in sorted({min(1024, max_len), max_len}):
        sam = SuffixAutomaton()
        t = time.perf_counter()
        sam.extend(0, text[:n])
        sam_s = time.perf_counter() - t
        detail = f"automaton {sam.num_states} states, ~{sam.approx_bytes() / 1e6:.2f} MB, {sam_s:.3f}s"
        index = SuffixIndex(64)
        t = time.perf_counter()
        index.extend(0, text[:n])
        detail += (f"; drafters' index (depth 64) {index.num_nodes} states, ~{index.approx_bytes() / 1e6:.2f} MB, "
                   f"{time.perf_counter() - t:.3f}s")
        if n <= 1024:
            for depth, label, digits in ((64, "reference trie (depth 64)", 2), (n, f"old oracle trie (depth {n})", 1)):
                trie = SuffixTrie(depth)
                t = time.perf_counter()
                trie.extend(0, text[:n])
                seconds = time.perf_counter() - t
                detail += (f"; {label} {trie.num_nodes} nodes, ~{trie.approx_bytes() / 1e6:.0f} MB, "
                           f"{seconds:.{digits}f}s")
        rows.append({"run": f"one {n}-token rollout", "methods": "cache oracle structure", "tokens": n,
                     "wall_s": float("nan"), "peak_rss_mb": float("nan"), "status": 0, "parts": detail})
    return rows

def main(argv=None) -> None:
    ap = parser("simulate-scale", "bench.harness.simulate on a synthetic log of real size: seconds, tokens/s, RSS")
    ap.add_argument("--size", choices=sorted(SIZES), default="default",
                    help="default: 8 steps x 128 rollouts; one-step: 1 x 1,024; ten-step: 10 x 1,024 (all of at "
                         "most 4,096 tokens)")
    ap.add_argument("--methods", default=None,
                    help="methods simulated together on the whole log (comma-separated; `copying` and `all` as "
                         "--method reads them; default: baseline,prefix_reuse_exact,future_oracle for the default "
                         "size, copying for the others)")
    ap.add_argument("--jobs", type=int, default=1, help="processes the methods simulated together share")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each command may run")
    ap.add_argument("--probe", default=None,
                    help="methods timed alone on a cut of the log (comma-separated, 'none'; default every other "
                         "simulable method)")
    ap.add_argument("--probe-prompts", type=int, default=0,
                    help="time the probe methods on the log cut to this many prompts (default 0: each alone on "
                         "the whole log)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: give a number of processes >= 1")
    (steps, prompts, samples), default_methods = SIZES[args.size]
    methods = default_methods if args.methods is None else [m for m in args.methods.split(",") if m]
    probe = None if args.probe is None else [m for m in args.probe.split(",") if m and m != "none"]
    print_rows(simulate_scale(methods=methods, probe=probe, steps=steps, prompts=prompts, samples=samples,
                              probe_prompts=args.probe_prompts, timeout=args.timeout, jobs=args.jobs))
