"""Offline replay of recorded rollouts through drafters, no model: acceptance numbers for traces and run logs.

    python -m bench.simulate TRACE_OR_LOG_DIR --method tree_cache --method history_spec [--out FILE]
    python -m bench.simulate TRACE_DIR --method tree_cache --method tree_cache:match=best   # a knob variant

A recorded token is a sample of the target policy, so the draft tokens that match a rollout's
recorded continuation are exactly what exact verification would accept (DESIGN.md section 1,
idea 3). Each step's rollouts form one batch, driven like ``TorchRefEngine.rollout``: ``start``
for every row, then per iteration ``propose`` for every live row (budget ``max_new_tokens -
len(output) - 1``, ``Draft.truncated``), the accepted path (``bench.verify.descend`` with the
recorded tokens as the samples: the deepest draft path whose tokens equal the recorded
continuation, chains and trees) plus one more recorded token (the bonus), cut at the end of the
recorded rollout, then ``observe`` for every row in order, then ``finish`` for rows whose
recorded tokens are exhausted. Each iteration opens with ``bench.drafting.report_live`` (the
live rows and their output lengths), as in the engine. The counters are the engine's, so
``bench.stats`` applies as is.

``oracle_tokens_per_step`` is the best any copying drafter could do with the same cache contents:
at each iteration a row's accepted length is the longest prefix of its remaining recorded tokens,
capped by the same budget, that occurs as a contiguous run anywhere in the texts of the prompt's
cache at that moment, and the row advances by that plus the bonus token (its own iteration, so
the oracle's siblings advance at the oracle's pace). The cache texts are every recorded rollout of
the same prompt finished before that iteration (all earlier steps, and siblings of this step that
already finished, as a finish-time history cache holds them), plus, for drafters that read
in-flight tokens (``in_flight`` tree caches, hybrid), the tokens emitted so far this step by the
prompt's running rollouts (its own included). It is a per-prompt bound: suffix_global's global trie may beat it on
repeats across prompts. Methods with the lenient ``ratio`` rule are refused (they need both
policies' probabilities: ``python -m bench.bias`` measures them); run-ahead needs the engine.

Inputs: a trace directory (its recorded rollouts and prompts), or a folder of run logs alone:
one jsonl or parquet file per step named ``step_<N>`` (``step_00003.parquet``, ``step_3.jsonl``)
with prompt_id, sample_idx, token_ids and optionally prompt_token_ids, logprobs, reward.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from methods.base import Draft, NullDrafter, Rollout, RolloutKey
from methods.oracle import OracleDrafter
from methods.suffix_tree import SuffixTrie

from .drafting import DraftCounters, next_draft, report_live
from .errors import UserError
from .stats import rollout_metrics, safe_div
from .trace import iter_jsonl
from .verify import descend, node_depths

METHOD_DIR = Path(__file__).resolve().parents[1] / "conf" / "method"
LOG_RE = re.compile(r"^step_?(\d+)\.(jsonl|parquet)$")
LOG_COLUMNS = ("prompt_id", "sample_idx", "token_ids")
LOG_LAYOUT = ("a trace directory (trace.yaml with recorded rollouts/step_XXXXX.parquet), or a folder "
              "of run logs: one file per step named step_<N>.jsonl or step_<N>.parquet "
              "(e.g. step_00003.parquet, step_3.jsonl) with prompt_id, sample_idx, token_ids and "
              "optional prompt_token_ids, logprobs, reward")
ROW_COLUMNS = ("method", "step", "prompt_id", "sample_idx", "output_len", "num_drafts", "num_draft_tokens",
               "num_accepted_tokens", "num_accepted_tokens_per_pos", "num_forward_passes",
               "oracle_num_forward_passes", "finish_reason", "reward")


class SimulationError(UserError, ValueError):
    """Input or method that cannot be simulated; the message names the file or method and the fix."""


class RecordedOracle(NullDrafter):
    """The oracle drafter over the recorded rollouts: each step's futures are that step's tokens.

    Selected with ``--method oracle``: every iteration drafts the whole remaining recorded
    continuation, so each rollout takes one forward pass (the upper bound of any drafter).
    """

    name = "oracle"

    def __init__(self, max_spec_tokens: int | None = None):
        self.max_spec_tokens = max_spec_tokens
        self._inner = OracleDrafter({}, max_spec_tokens)

    def set_futures(self, futures: Mapping[RolloutKey, list[int]]) -> None:
        self._inner = OracleDrafter(futures, self.max_spec_tokens)

    def start(self, key, prompt):
        self._inner.start(key, prompt)

    def propose(self, key, output, budget):
        return self._inner.propose(key, output, budget)

    def observe(self, key, new_tokens):
        self._inner.observe(key, new_tokens)

    def stats(self) -> dict:
        return {}


# ---------------------------------------------------------------- methods

def method_config(name: str):
    """The method's config (``conf/method/<name>.yaml``); ``oracle`` is the built-in recorded oracle.

    ``NAME:knob=value,knob=value`` is that config with drafter knobs overridden (values read as
    YAML), e.g. ``tree_cache:match=best`` or ``seer:max_batch_draft_tokens=null``.
    """
    from omegaconf import OmegaConf
    if ":" in name:
        import yaml
        base, _, sets = name.partition(":")
        cfg = method_config(base)
        for item in filter(None, sets.split(",")):
            knob, eq, value = item.partition("=")
            if not eq or knob.strip() not in cfg.drafter:
                raise SimulationError(f"method {name!r}: {item!r} is not knob=value for a knob of "
                                      f"{base!r}; its knobs: {sorted(k for k in cfg.drafter if k != '_target_')}")
            cfg.drafter[knob.strip()] = yaml.safe_load(value)
        cfg.name = name
        return cfg
    if name == "oracle":
        return OmegaConf.create({"name": "oracle", "drafter": {"_target_": "bench.simulate.RecordedOracle"},
                                 "verify": {"rule": "exact"}, "run_ahead": False})
    path = METHOD_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in METHOD_DIR.glob("*.yaml")) + ["oracle"]
        raise SimulationError(f"unknown method {name!r}: {path} does not exist; known methods: {known}")
    return OmegaConf.load(path)


def simulable_methods() -> list[str]:
    """Every configured method simulation can run (exact rules, no run-ahead), plus the oracle."""
    out = []
    for p in sorted(METHOD_DIR.glob("*.yaml")):
        try:
            check_simulable(p.stem, method_config(p.stem))
        except SimulationError:
            continue
        out.append(p.stem)
    return out + ["oracle"]


def check_simulable(name: str, cfg) -> None:
    verify = cfg.get("verify") or {}
    rule = verify.get("rule", "exact")
    if rule == "ratio":
        raise SimulationError(
            f"method {name!r} uses verify.rule=ratio (SPEC-RL's lenient test), which accepts by the "
            f"ratio of the new and old policies' probabilities: recorded tokens cannot tell what it "
            f"would accept, simulation needs exact verification. Simulate prefix_reuse_exact (the same "
            f"cache, exact rule), or measure the ratio rule's bias with `python -m bench.bias TRACE_DIR`")
    if cfg.get("run_ahead"):
        raise SimulationError(f"method {name!r} has run_ahead: true; run-ahead rollouts are generated by "
                              f"the engine and are not in the recorded rollouts, so simulation cannot "
                              f"replay them: simulate the method without run-ahead (e.g. tree_cache)")


def build_drafter(name: str, cfg):
    """A drafter from a method config (mapping with ``drafter``/``verify``) or a drafter instance."""
    if hasattr(cfg, "propose"):
        return cfg
    check_simulable(name, cfg)
    from hydra.utils import instantiate
    return instantiate(cfg["drafter"])


def uses_in_flight(drafter) -> bool:
    """Whether the drafter reads tokens of rollouts still running (decides the oracle's cache)."""
    if isinstance(drafter, RecordedOracle):
        return False
    inner = getattr(drafter, "tree_cache", None)  # hybrid
    return bool(getattr(inner if inner is not None else drafter, "in_flight", False))


# ---------------------------------------------------------------- the replay loop

class _Live:
    __slots__ = ("key", "rec", "logprobs", "reward", "finish_reason", "pos", "counters")

    def __init__(self, key, rec, logprobs, reward, finish_reason):
        self.key, self.rec, self.logprobs, self.reward = key, rec, logprobs, reward
        self.finish_reason = finish_reason
        self.pos = 0
        self.counters = DraftCounters()


def _step_rows(df: pd.DataFrame, max_new_tokens: int) -> list[_Live]:
    has_lp, has_rew, has_fr = "logprobs" in df, "reward" in df, "finish_reason" in df
    rows = []
    for i, (pid, idx, toks) in enumerate(zip(df["prompt_id"], df["sample_idx"], df["token_ids"])):
        rec = [int(t) for t in toks][:max_new_tokens]
        lp = [float(x) for x in df["logprobs"].iat[i]][:len(rec)] if has_lp and df["logprobs"].iat[i] is not None else []
        if len(lp) != len(rec):
            lp = [0.0] * len(rec)  # only the ratio rule reads logprobs, and it is refused
        fr = str(df["finish_reason"].iat[i]) if has_fr else ("length" if len(rec) >= max_new_tokens else "stop")
        rows.append(_Live(RolloutKey(str(pid), int(idx)), rec, lp,
                          float(df["reward"].iat[i]) if has_rew else float("nan"), fr))
    return rows


def _accept(rec: list[int], t: int, draft: Draft) -> tuple[list[int], int]:
    """Emitted tokens and accepted count of one iteration at output length t (recorded = sampled)."""
    if not draft.token_ids:
        return rec[t:t + 1], 0
    n = len(rec)
    sampled = [rec[t + d] if t + d < n else -1 for d in node_depths(draft)]  # -1: past the end, no match
    _, path = descend(sampled, draft)
    k = len(path) - 1
    emitted = rec[t:t + k + 1]  # accepted + bonus, cut at the end of the recorded rollout
    return emitted, min(k, len(emitted))


def _run_step(drafter, step: int, rows: list[_Live], prompts: Mapping[str, list[int]],
              max_new_tokens: int) -> list[_Live]:
    """One step through the drafter in the engine's call order; returns the rows in finish order."""
    if isinstance(drafter, RecordedOracle):
        drafter.set_futures({r.key: r.rec for r in rows})
    drafter.begin_step(step)
    for r in rows:
        drafter.start(r.key, list(prompts.get(r.key.prompt_id, ())))
    finished: list[_Live] = []
    live = rows
    while live:
        report_live(drafter, [(r.key, r.pos) for r in live])
        drafts = [next_draft(drafter, r.key, r.rec[:r.pos], max_new_tokens) for r in live]
        for r, d in zip(live, drafts):
            if r.pos < len(r.rec):
                emitted, accepted = _accept(r.rec, r.pos, d)
            else:  # an empty recorded rollout: nothing to emit
                emitted, accepted = [], 0
            r.counters.record(len(d), accepted)
            r.pos += len(emitted)
            drafter.observe(r.key, emitted)
        keep = []
        for r in live:
            if r.pos < len(r.rec):
                keep.append(r)
                continue
            drafter.finish(r.key, Rollout(
                key=r.key, step=step, prompt_token_ids=list(prompts.get(r.key.prompt_id, ())),
                token_ids=list(r.rec), logprobs=list(r.logprobs), finish_reason=r.finish_reason,
                **r.counters.as_dict()))
            finished.append(r)
        live = keep
    return finished


# ---------------------------------------------------------------- the oracle

def _longest_prefix(trie: SuffixTrie, rec: list[int], t: int, limit: int) -> int:
    """Largest m <= limit with rec[t:t+m] a root path of the trie (prefixes of a path are paths)."""
    lo, hi = 0, min(limit, len(rec) - t, trie.max_depth)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if trie.find(rec, t, t + mid) is not None:
            lo = mid
        else:
            hi = mid - 1
    return lo


def oracle_passes(rollouts_by_step: Mapping[int, pd.DataFrame], max_new_tokens: int,
                  in_flight: bool) -> dict[tuple[int, str, int], int]:
    """Forward passes per (step, prompt_id, sample_idx) of the cache oracle (module docstring)."""
    tries: dict[str, SuffixTrie] = {}
    passes: dict[tuple[int, str, int], int] = {}
    seq = 0
    for step in sorted(rollouts_by_step):
        rows = _step_rows(rollouts_by_step[step], max_new_tokens)
        ids = {}
        for r in rows:
            tries.setdefault(r.key.prompt_id, SuffixTrie(max(1, max_new_tokens)))
            ids[r.key], seq = seq, seq + 1
        live = rows
        while live:
            lengths = []
            for r in live:  # every row sees the cache as it was when the iteration began
                budget = max_new_tokens - r.pos - 1
                m = _longest_prefix(tries[r.key.prompt_id], r.rec, r.pos, budget) if budget > 0 else 0
                lengths.append(min(m + 1, len(r.rec) - r.pos))
            for r, n in zip(live, lengths):
                if in_flight and n > 0:
                    tries[r.key.prompt_id].extend(ids[r.key], r.rec[r.pos:r.pos + n])
                r.pos += n
                r.counters.num_forward_passes += 1
            for r in live:
                if r.pos >= len(r.rec):
                    passes[(step, r.key.prompt_id, r.key.sample_idx)] = r.counters.num_forward_passes
                    if not in_flight and r.rec:
                        tries[r.key.prompt_id].extend(ids[r.key], r.rec)
            live = [r for r in live if r.pos < len(r.rec)]
    return passes


# ---------------------------------------------------------------- API

def simulate(rollouts_by_step: Mapping[int, pd.DataFrame], prompts: Mapping[str, list[int]],
             method_cfgs: Mapping[str, Any], max_new_tokens: int, progress: bool = False) -> pd.DataFrame:
    """Per-rollout rows (``ROW_COLUMNS``) of every method over the steps in increasing order.

    method_cfgs: name -> method config (a mapping with ``drafter`` and ``verify``, as in
    ``conf/method/<name>.yaml``) or a drafter instance (taken to be verified exactly). Each
    method gets a fresh drafter that lives across all steps.
    """
    if max_new_tokens < 1:
        raise SimulationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    drafters = {name: build_drafter(name, cfg) for name, cfg in method_cfgs.items()}
    from tqdm.auto import tqdm
    oracles: dict[bool, dict] = {}
    frames = []
    for name, drafter in drafters.items():
        flag = uses_in_flight(drafter)
        if flag not in oracles:
            oracles[flag] = oracle_passes(rollouts_by_step, max_new_tokens, flag)
        out = []
        for step in tqdm(sorted(rollouts_by_step), desc=f"simulate {name}", disable=not progress):
            rows = _step_rows(rollouts_by_step[step], max_new_tokens)
            order = {r.key: i for i, r in enumerate(rows)}
            done = sorted(_run_step(drafter, step, rows, prompts, max_new_tokens), key=lambda r: order[r.key])
            out += [(name, step, r.key.prompt_id, r.key.sample_idx, len(r.rec), r.counters.num_drafts,
                     r.counters.num_draft_tokens, r.counters.num_accepted_tokens,
                     r.counters.num_accepted_tokens_per_pos, r.counters.num_forward_passes,
                     oracles[flag].get((step, r.key.prompt_id, r.key.sample_idx), 0), r.finish_reason, r.reward)
                    for r in done]
        frames.append(pd.DataFrame(out, columns=list(ROW_COLUMNS)))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(ROW_COLUMNS))


def summarize(rows: pd.DataFrame, per_step: bool = False) -> pd.DataFrame:
    """Section-5 metrics per method (and step), via ``bench.stats``, plus oracle_tokens_per_step."""
    by = ["method", "step"] if per_step else ["method"]
    out = rollout_metrics(rows, by)
    g = rows.groupby(by, dropna=False, sort=True)
    per_pos = g["num_accepted_tokens_per_pos"].agg(_sum_lists).reset_index()
    oracle = g[["output_len", "oracle_num_forward_passes"]].sum().reset_index()
    oracle["oracle_tokens_per_step"] = safe_div(oracle["output_len"], oracle["oracle_num_forward_passes"])
    out = out.merge(per_pos, on=by).merge(oracle[by + ["oracle_tokens_per_step"]], on=by)
    order = {m: i for i, m in enumerate(dict.fromkeys(rows["method"]))}  # the order methods were given
    return out.sort_values(by, key=lambda s: s.map(order) if s.name == "method" else s).reset_index(drop=True)


def _sum_lists(lists) -> list[int]:
    total: list[int] = []
    for xs in lists:
        xs = list(xs)
        if len(total) < len(xs):
            total += [0] * (len(xs) - len(total))
        for i, x in enumerate(xs):
            total[i] += int(x)
    return total


# ---------------------------------------------------------------- inputs

def load_input(path: str | Path) -> tuple[dict[int, pd.DataFrame], dict[str, list[int]], int | None]:
    """(rollouts by step, prompts, max_new_tokens or None) from a trace dir or a log folder."""
    root = Path(path)
    if not root.is_dir():
        raise SimulationError(f"{root} is not a directory; expected {LOG_LAYOUT}")
    from .trace import MANIFEST, Trace, TraceError
    if (root / MANIFEST).exists():
        try:
            trace = Trace.load(root, validate=False)  # checkpoints are not needed: no model here
        except TraceError as exc:
            raise SimulationError(str(exc)) from exc
        steps = {}
        for s in trace.steps:
            if s.rollouts is not None:
                steps[s.step] = trace.rollouts(s.step)
        if not steps:
            raise SimulationError(f"trace {root} records no rollouts (no step has a `rollouts` file in "
                                  f"{root / MANIFEST}); simulation replays recorded rollouts: re-record "
                                  f"the trace with rollouts or pass a folder of run logs")
        return steps, dict(trace.prompts), trace.sampling.max_new_tokens
    files = {}
    for f in sorted(root.iterdir()):
        m = LOG_RE.match(f.name)
        if m:
            step = int(m.group(1))
            if step in files:
                raise SimulationError(f"{root}: step {step} has two log files ({files[step].name}, {f.name}); "
                                      f"keep one per step")
            files[step] = f
    if not files:
        raise SimulationError(f"{root} holds neither a trace (no {MANIFEST}) nor rollout logs (no "
                              f"step_<N>.jsonl / step_<N>.parquet files); expected {LOG_LAYOUT}")
    steps, prompts = {}, {}
    for step, f in sorted(files.items()):
        df = pd.read_parquet(f) if f.suffix == ".parquet" else _read_jsonl(f)
        missing = [c for c in LOG_COLUMNS if c not in df.columns]
        if missing:
            raise SimulationError(f"{f} lacks columns {missing}; each log row needs {list(LOG_COLUMNS)} "
                                  f"(optional: prompt_token_ids, logprobs, reward)")
        df = df.assign(prompt_id=df["prompt_id"].astype(str))
        if "prompt_token_ids" in df:
            for pid, ids in zip(df["prompt_id"], df["prompt_token_ids"]):
                if ids is not None and pid not in prompts:
                    prompts[pid] = [int(t) for t in ids]
        steps[step] = df
    return steps, prompts, None


def _read_jsonl(path: Path) -> pd.DataFrame:
    return pd.DataFrame.from_records([r for _, r in iter_jsonl(path, SimulationError)])


# ---------------------------------------------------------------- CLI

SHOW = ["method", "num_rollouts", "output_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
        "mean_acceptance_length", "acceptance_rate", "tokens_per_step", "draft_contribution",
        "oracle_tokens_per_step"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input", type=Path, help="a trace directory or a folder of per-step rollout logs")
    ap.add_argument("--method", action="append", required=True,
                    help="a conf/method name, `oracle`, or `all` (every simulable method); repeatable; "
                         "NAME:knob=value,... overrides drafter knobs (e.g. tree_cache:match=best)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="draft budget cap (default: the trace's; for logs, the longest rollout)")
    ap.add_argument("--out", type=Path, help="write the per-step table (.csv or .parquet)")
    ap.add_argument("--rollouts-out", type=Path, help="write the per-rollout rows (.parquet)")
    ap.add_argument("--per-step", action="store_true", help="also print the per-step table")
    args = ap.parse_args(argv)
    try:
        steps, prompts, max_new = load_input(args.input)
        names = [n for m in args.method for n in (simulable_methods() if m == "all" else [m])]
        cfgs = {n: method_config(n) for n in dict.fromkeys(names)}
        for n, c in cfgs.items():
            check_simulable(n, c)
    except SimulationError as exc:
        sys.exit(f"bench.simulate: {exc}")
    max_new = args.max_new_tokens or max_new or max(len(t) for df in steps.values() for t in df["token_ids"])
    n_rollouts = sum(len(df) for df in steps.values())
    print(f"{args.input}: {len(steps)} steps, {n_rollouts} rollouts, max_new_tokens {max_new}")
    t0 = time.perf_counter()
    rows = simulate(steps, prompts, cfgs, max_new, progress=True)
    wall = time.perf_counter() - t0
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 30)
    table = summarize(rows)
    print(table[SHOW].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    per_step = summarize(rows, per_step=True)
    if args.per_step:
        print(per_step[["step", *SHOW]].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"simulated {len(cfgs)} methods in {wall:.1f}s")
    if args.out:
        _write(per_step, args.out)
    if args.rollouts_out:
        _write(rows, args.rollouts_out)


def _write(df: pd.DataFrame, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        df.to_csv(path, index=False)
    else:
        df.to_parquet(path, index=False)
    print(f"wrote {path}")


if __name__ == "__main__":
    # run the importable module's main, so config targets (bench.simulate.RecordedOracle) are its classes
    from bench.errors import run_main
    from bench.simulate import main as _main
    run_main(_main)
