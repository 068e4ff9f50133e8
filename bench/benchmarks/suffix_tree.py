"""The suffix structures' cost: per token (append, speculate) on repetitive text, and with
``--live-rows`` per engine iteration at real size (256 rows x 4,096 tokens, vocabulary 151,936),
the pure-Python trie against the native backend.

    python -m bench.benchmarks suffix-tree
    python -m bench.benchmarks suffix-tree --live-rows 256
"""
from __future__ import annotations
import time
from methods.base import RolloutKey
from bench.core.paths import METHOD_CONF_DIR
from bench.benchmarks.helpers import parser
from bench.benchmarks.helpers import print_rows
from bench.benchmarks.helpers import torch_setup


def suffix_tree_cost(depths=(24, 64), prompts: int = 8, n: int = 8, length: int = 200, vocab: int = 40,
                     visits: int = 3) -> list[dict]:
    """The pure-Python trie as the SRT drafter drives it: ``prompts`` x ``n`` rollouts of
    repetitive random text (phrases of a small vocabulary, as rollouts of one prompt repeat each
    other), generated token by token in lockstep, one propose and one in-flight append per token,
    over several visits so earlier rollouts are in the tree."""
    import random
    from methods.base import Rollout
    from methods.tree_cache import TreeCacheDrafter
    rng = random.Random(0)
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(3, 12))] for _ in range(30)]

    def text() -> list[int]:
        s: list[int] = []
        while len(s) < length:
            s += phrases[rng.randrange(len(phrases))] if rng.random() < 0.8 else [rng.randrange(vocab)]
        return s[:length]

    rows = []
    for depth in depths:
        drafter = TreeCacheDrafter(max_depth=depth)
        t_obs = t_prop = 0.0
        tokens = proposals = 0
        for visit in range(visits):
            drafter.begin_step(visit)
            keys = [RolloutKey(f"p{p}", i) for p in range(prompts) for i in range(n)]
            outs = {k: text() for k in keys}
            for k in keys:
                drafter.start(k, [1, 2, 3])
            for pos in range(length):
                for k in keys:
                    t = time.perf_counter()
                    drafter.propose(k, outs[k][:pos], 24)
                    t_prop += time.perf_counter() - t
                    t = time.perf_counter()
                    drafter.observe(k, outs[k][pos:pos + 1])
                    t_obs += time.perf_counter() - t
                proposals += len(keys)
                tokens += len(keys)
            for k in keys:
                drafter.finish(k, Rollout(k, visit, [1, 2, 3], outs[k], [0.0] * length, "length"))
        rows.append({"backend": "python", "depth": depth, "append_us_per_token": 1e6 * t_obs / tokens,
                     "propose_us_per_call": 1e6 * t_prop / proposals, "nodes": drafter.stats().get("nodes")})
        rows += _native_cost(depth, prompts, n, length, visits, text)
    return rows


def drafter_scale(methods=("tree_cache", "das", "seer", "suffix_global"), backends=("python", "native"),
                  prompts: int = 32, n: int = 8, history: int = 4, length: int = 4096, at: int = 1024,
                  iters: int = 32, vocab: int = 151_936, match: str | None = "best") -> list[dict]:
    """Per-iteration drafter cost at ``prompts`` x ``n`` live rows with ``length``-token rollouts.

    Each prompt's tries first hold ``history`` earlier ``length``-token rollouts (their phrases
    drawn from a pool per prompt, as a prompt's rollouts repeat each other); the live rows are
    fast-forwarded to output length ``at``; then ``iters`` engine iterations are timed, each one
    ``begin_iteration`` and, per row, one ``propose`` (budget 24) and one one-token ``observe``.
    ``match`` overrides the match rule where a method has one (best: the rule both backends run).
    """
    rows = []
    for method in methods:
        for backend in backends:
            text = _repetitive_text(prompts, length, vocab)
            drafter, cfg = _configured_drafter(method, backend, match)
            t0 = time.perf_counter()
            keys, live, outs = _fill(drafter, text, prompts, n, history, length, at)
            build_s = time.perf_counter() - t0
            timed = _time_iterations(drafter, keys, live, outs, iters)
            rows.append({"method": method, "backend": drafter.backend, "match": cfg.get("match", "-"),
                         "rows": len(keys), "history_tokens": prompts * history * length,
                         "build_s": build_s, **timed})
            print(rows[-1], flush=True)
    return rows


def _repetitive_text(prompts: int, length: int, vocab: int):
    """``text(p)``: a ``length``-token rollout of prompt ``p``, 80% phrases from the prompt's own
    pool of 200 (as a prompt's rollouts repeat each other), 20% random tokens; seeded, so every
    (method, backend) sees the same texts in the same order."""
    import random
    rng = random.Random(0)
    pools = [[[rng.randrange(vocab) for _ in range(rng.randint(3, 12))] for _ in range(200)] for _ in range(prompts)]

    def text(p: int) -> list[int]:
        s: list[int] = []
        while len(s) < length:
            s += pools[p][rng.randrange(200)] if rng.random() < 0.8 else [rng.randrange(vocab)]
        return s[:length]
    return text


def _configured_drafter(method: str, backend: str, match: str | None):
    """The method's drafter from its config, on ``backend``, with ``match`` where it has one."""
    import hydra.utils
    from omegaconf import OmegaConf
    cfg = OmegaConf.load(METHOD_CONF_DIR / f"{method}.yaml").drafter
    cfg.backend = backend
    if match is not None and "match" in cfg:
        cfg.match = match
    return hydra.utils.instantiate(cfg), cfg


def _fill(drafter, text, prompts: int, n: int, history: int, length: int, at: int):
    """``history`` finished visits of every prompt, then ``prompts`` x ``n`` live rows fast-forwarded
    to output length ``at``: the live keys, their outputs so far and their whole rollouts."""
    from methods.base import Rollout
    for visit in range(history):
        drafter.begin_step(visit)
        for k in [RolloutKey(f"p{p}", visit) for p in range(prompts)]:
            out = text(int(k.prompt_id[1:]))
            drafter.start(k, [1, 2, 3])
            drafter.observe(k, out)
            drafter.finish(k, Rollout(k, visit, [1, 2, 3], out, [0.0] * length, "length"))
    drafter.begin_step(history)
    keys = [RolloutKey(f"p{p}", 1000 + i) for p in range(prompts) for i in range(n)]
    outs = {k: text(int(k.prompt_id[1:])) for k in keys}
    live = {k: outs[k][:at] for k in keys}
    for k in keys:
        drafter.start(k, [1, 2, 3])
        drafter.observe(k, live[k])
    return keys, live, outs


def _time_iterations(drafter, keys, live, outs, iters: int) -> dict:
    """``iters`` engine iterations: ``begin_iteration``, then per row one ``propose`` (budget 24)
    and a one-token ``observe``; the seconds of each kind of call."""
    hook = getattr(drafter, "begin_iteration", None)
    t_prop = t_obs = t_iter = 0.0
    drafted = 0
    for _ in range(iters):
        report = [(k, len(live[k])) for k in keys]
        t = time.perf_counter()
        if hook is not None:
            hook(report)
        t_iter += time.perf_counter() - t
        for k in keys:
            out = live[k]
            t = time.perf_counter()
            drafted += len(drafter.propose(k, out, 24))
            t_prop += time.perf_counter() - t
            new = outs[k][len(out):len(out) + 1]
            out += new
            t = time.perf_counter()
            drafter.observe(k, new)
            t_obs += time.perf_counter() - t
    calls = iters * len(keys)
    return {"ms_per_iteration": 1e3 * (t_prop + t_obs + t_iter) / iters, "propose_us": 1e6 * t_prop / calls,
            "observe_us": 1e6 * t_obs / calls, "begin_iteration_ms": 1e3 * t_iter / iters,
            "draft_tokens_per_row": drafted / calls}

def _native_cost(depth, prompts, n, length, visits, text) -> list[dict]:
    """The same lockstep workload on arctic-inference's C++ tree (one per prompt), if installed."""
    from methods.suffix.tree import NativeSuffixTree
    try:
        trees = {p: NativeSuffixTree(depth) for p in range(prompts)}
    except ImportError:
        return []
    t_ext = t_spec = 0.0
    calls = 0
    for visit in range(visits):
        outs = {(p, i): text() for p in range(prompts) for i in range(n)}
        for pos in range(length):
            for (p, i), out in outs.items():
                seq_id = (visit * n + i)
                t = time.perf_counter()
                trees[p].speculate(out[max(0, pos - depth):pos], 24, 1.0, 0.0, 0.1, False)
                t_spec += time.perf_counter() - t
                t = time.perf_counter()
                trees[p].extend(seq_id, out[pos:pos + 1])
                t_ext += time.perf_counter() - t
                calls += 1
    return [{"backend": "native", "depth": depth, "append_us_per_token": 1e6 * t_ext / calls,
             "propose_us_per_call": 1e6 * t_spec / calls, "nodes": None}]


def main(argv=None) -> None:
    ap = parser("suffix-tree", "suffix trie append / speculate cost per token; with --live-rows, the drafters' "
                "cost per engine iteration, python vs native")
    ap.add_argument("--live-rows", type=int, default=0,
                    help="instead, the per-iteration drafter cost at this many live rows (8 per prompt) with "
                         "--length-token rollouts, 4 earlier rollouts per prompt, python vs native")
    ap.add_argument("--length", type=int, default=4096, help="--live-rows: rollout length")
    ap.add_argument("--iters", type=int, default=32, help="--live-rows: timed engine iterations")
    ap.add_argument("--backend", default=None, choices=["auto", "python", "native"],
                    help="--live-rows: the tree drafters' backend knob (default: python and native)")
    ap.add_argument("--match", default=None, choices=["longest", "best"], help="--live-rows: the match rule")
    ap.add_argument("--methods", default="tree_cache,das,seer,suffix_global",
                    help="--live-rows: only these methods (comma-separated)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch_setup(args.threads)
    if not args.live_rows:
        return print_rows(suffix_tree_cost())
    backends = ("python", "native") if args.backend is None else (args.backend,)
    print_rows(drafter_scale(methods=args.methods.split(","), backends=backends,
                             prompts=max(1, args.live_rows // 8), length=args.length, at=args.length // 4,
                             iters=args.iters, match=args.match or "best"))
