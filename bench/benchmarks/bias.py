"""Bias audit of SPEC-RL's lenient ratio rule: how far its token distribution is from the policy's.

    python -m bench.benchmarks.bias TRACE_DIR [--lenience 1.6487] [--steps 2 3] [--no-reward]

For every revisited prompt slot (the old rollout x of the slot's previous visit is the draft,
sampled from the old checkpoint's distribution q; the step's checkpoint is the target p), one
forward pass of each checkpoint over prompt + x gives both full next-token distributions at every
draft position (``bench.core.sampling.processed_probs`` with the trace's sampling). The ratio rule
accepts x_t ~ q_t with probability a_t(x) = min(1, l * p~_t(x) / q~_t(x)), where p~, q~ are the
temperature-scaled distributions whose logprobs ``bench.core.verify.ratio_accept`` compares (equal to
p, q without top-p/top-k), and otherwise emits a plain sample of p, so position t produces

    r_t = q_t * a_t + (1 - sum(q_t * a_t)) * p_t       (= min(q, l p) + (1 - sum min(q, l p)) p)

instead of p_t; its bias is TV(r_t, p_t) = 1/2 sum |r_t - p_t|. After the first rejection the
rule samples p exactly, so only draft positions the rule reaches count. ``bias_tv_per_token`` is
the reach-weighted mean sum_t w_t TV_t / sum_t w_t over all slots, with w_t the probability that
the rule reaches position t on the recorded draft, w_t = prod_{j<t} a_j(x_j). This choice (rather
than the product of mean acceptances sum(q_j a_j)) keeps the reached prefix and its weight
consistent: the recorded x is a sample of q, so both sums are unbiased estimates of their
expectations over drafts. Draft positions are those the engine verifies: t < min(len(x),
max_new_tokens - 1). The reward delta runs the torch reference engine with prefix reuse (ratio
rule, draft = the recorded previous visit) and with the baseline on the same steps, and compares
mean task rewards (``Trace.reward``).
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import OrderedDict
from pathlib import Path

import pandas as pd
import torch

from bench.core.sampling import SamplingConfig, processed_probs, scaled_logits

SPEC_RL_GRPO_LENIENCE = math.exp(0.5)


# ---------------------------------------------------------------- the exact per-position formula

def rule_distribution(q: torch.Tensor, p: torch.Tensor, lenience: float, q_ratio: torch.Tensor | None = None,
                      p_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """The ratio rule's output distribution r given draft q and target p: [..., V] -> [..., V] float64.

    q_ratio, p_ratio: the distributions whose ratio the acceptance test reads (default q, p).
    Example: q = [0.5, 0.5], p = [0.9, 0.1], l = 1: accepted mass min(q, p) = [0.5, 0.1], rejected
    0.4 goes to p -> r = [0.86, 0.14], TV 0.04.
    """
    q, p = q.to(torch.float64), p.to(torch.float64)
    q_r = q if q_ratio is None else q_ratio.to(torch.float64)
    p_r = p if p_ratio is None else p_ratio.to(torch.float64)
    accept = torch.where(q > 0, torch.clamp(lenience * p_r / q_r.clamp_min(1e-300), max=1.0), 0.0)
    accepted = q * accept
    return accepted + (1.0 - accepted.sum(-1, keepdim=True)).clamp_min(0.0) * p


def tv_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Total variation 1/2 sum |a - b| over the last dim."""
    return 0.5 * (a.to(torch.float64) - b.to(torch.float64)).abs().sum(-1)


def monte_carlo_tv(q: torch.Tensor, p: torch.Tensor, lenience: float, samples: int = 200_000, seed: int = 0,
                   q_ratio: torch.Tensor | None = None, p_ratio: torch.Tensor | None = None) -> tuple[float, float]:
    """Sample the rule at one position (x ~ q; accept if u <= min(1, l p~(x)/q~(x)); else y ~ p).

    q, p: [V]. Returns (TV of the empirical output distribution against p, its sampling error
    scale: the expected TV between an n-sample histogram and the exact r, which bounds
    |estimate - exact| by the triangle inequality).
    """
    g = torch.Generator().manual_seed(seed)
    q, p = q.to(torch.float64), p.to(torch.float64)
    q_r = q if q_ratio is None else q_ratio.to(torch.float64)
    p_r = p if p_ratio is None else p_ratio.to(torch.float64)
    x = torch.multinomial(q, samples, replacement=True, generator=g)
    u = torch.rand(samples, generator=g, dtype=torch.float64)
    accept = u <= torch.clamp(lenience * p_r[x] / q_r[x], max=1.0)
    y = torch.multinomial(p, samples, replacement=True, generator=g)
    out = torch.where(accept, x, y)
    emp = torch.bincount(out, minlength=q.numel()).to(torch.float64) / samples
    r = rule_distribution(q, p, lenience, q_ratio, p_ratio)
    noise = 0.5 * float(torch.sqrt(2 * r * (1 - r) / (math.pi * samples)).sum())
    return float(tv_distance(emp, p)), noise


# ---------------------------------------------------------------- distributions from checkpoints

class _Models:
    """A few checkpoints kept loaded (float64), least recently used dropped first."""

    def __init__(self, size: int = 3):
        self.size, self._m = size, OrderedDict()

    def get(self, path: Path):
        key = str(path)
        if key not in self._m:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
            self._m[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float64).eval()
            while len(self._m) > self.size:
                self._m.popitem(last=False)
        self._m.move_to_end(key)
        return self._m[key]


@torch.inference_mode()
def _next_token_logits(model, prompts: list[list[int]], drafts: list[list[int]]) -> list[torch.Tensor]:
    """Per row, logits [len(draft), V] predicting each draft token (one right-padded forward)."""
    seqs = [pr + dr for pr, dr in zip(prompts, drafts)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits  # [B, width, V]
    return [logits[i, len(pr) - 1:len(pr) - 1 + len(dr)] for i, (pr, dr) in enumerate(zip(prompts, drafts))]


def previous_visits(trace, steps: list[int]) -> list[tuple[int, int, pd.DataFrame, pd.DataFrame]]:
    """(step, previous step, previous rollouts, this step's rollouts) for each step with revisits."""
    last: dict[str, int] = {}
    frames: dict[int, pd.DataFrame] = {}
    out = []
    for s in trace.steps:
        df = trace.rollouts(s.step)
        if df is None:
            continue
        frames[s.step] = df
        if s.step in steps:
            for prev in sorted({last[p] for p in set(df.prompt_id) if p in last}):
                pids = {p for p in set(df.prompt_id) if last.get(p) == prev}
                out.append((s.step, prev, frames[prev][frames[prev].prompt_id.isin(pids)], df))
        for p in set(df.prompt_id):
            last[p] = s.step
    return out


def audit_slots(trace, lenience: float, steps: list[int] | None = None, models: _Models | None = None) -> pd.DataFrame:
    """One row per revisited slot: step, prev_step, prompt_id, sample_idx, positions, reach (sum w),
    expected_accepted (sum_{t>=1} w_t + w_T: the rule's mean accepted draft length on this draft),
    tv_weighted (sum w TV), tv_first (TV at position 0)."""
    sampling = trace.sampling.to_config()
    if sampling.greedy:
        raise ValueError("the ratio rule's bias audit needs temperature > 0 (the trace samples greedily)")
    steps = trace.step_numbers if steps is None else list(steps)
    models = models or _Models()
    rows = []
    for step, prev, old, new in previous_visits(trace, steps):
        cap = sampling.max_new_tokens - 1
        keys = [(str(p), int(i)) for p, i in zip(old.prompt_id, old.sample_idx)]
        drafts = [[int(t) for t in toks][:cap] for toks in old.token_ids]
        keep = [i for i, d in enumerate(drafts) if d]
        keys, drafts = [keys[i] for i in keep], [drafts[i] for i in keep]
        prompts = [list(trace.prompts[p]) for p, _ in keys]
        q_logits = _next_token_logits(models.get(trace.checkpoint(prev)), prompts, drafts)
        p_logits = _next_token_logits(models.get(trace.checkpoint(step)), prompts, drafts)
        for (pid, idx), draft, ql, pl in zip(keys, drafts, q_logits, p_logits):
            r_tv, a = _position_bias(ql, pl, draft, sampling, lenience)
            w = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(a, 0)[:-1]])
            rows.append({"step": step, "prev_step": prev, "prompt_id": pid, "sample_idx": idx,
                         "positions": len(draft), "reach": float(w.sum()),
                         "expected_accepted": float(w[1:].sum() + a.prod()),
                         "tv_weighted": float((w * r_tv).sum()), "tv_first": float(r_tv[0])})
    return pd.DataFrame(rows, columns=["step", "prev_step", "prompt_id", "sample_idx", "positions", "reach",
                                       "expected_accepted", "tv_weighted", "tv_first"])


def _position_bias(q_logits, p_logits, draft, sampling: SamplingConfig, lenience: float):
    """TV(r_t, p_t) per position [T], and the acceptance probability a_t(x_t) of the drafted token [T]."""
    q, p = processed_probs(q_logits, sampling), processed_probs(p_logits, sampling)
    q_r = torch.softmax(scaled_logits(q_logits, sampling).to(torch.float64), -1)
    p_r = torch.softmax(scaled_logits(p_logits, sampling).to(torch.float64), -1)
    r = rule_distribution(q, p, lenience, q_r, p_r)
    x = torch.tensor(draft)[:, None]
    a = torch.clamp(lenience * p_r.gather(1, x) / q_r.gather(1, x), max=1.0).squeeze(1)
    return tv_distance(r, p), a


def summarize_bias(slots: pd.DataFrame) -> pd.DataFrame:
    """bias_tv_per_token per step and overall (step 'all'), with slots, draft positions and reach."""
    def agg(g):
        reach = g["reach"].sum()
        return pd.Series({"slots": len(g), "draft_positions": int(g["positions"].sum()),
                          "reached_positions": reach, "expected_accepted": g["expected_accepted"].sum(),
                          "bias_tv_per_token": g["tv_weighted"].sum() / reach if reach else float("nan"),
                          "tv_first_mean": g["tv_first"].mean()})
    per_step = slots.groupby("step").apply(agg, include_groups=False).reset_index()
    overall = agg(slots).to_frame().T.assign(step="all")
    return pd.concat([per_step.astype({"step": object}), overall[per_step.columns]], ignore_index=True)


# ---------------------------------------------------------------- Monte-Carlo check on trace positions

def monte_carlo_check(trace, lenience: float, positions: int = 3, samples: int = 200_000,
                      models: _Models | None = None) -> pd.DataFrame:
    """Exact TV vs a sampled estimate at the first ``positions`` draft positions of the first revisit."""
    sampling = trace.sampling.to_config()
    models = models or _Models()
    visits = previous_visits(trace, trace.step_numbers)
    if not visits:
        raise ValueError(f"trace {trace.root} revisits no prompt: nothing to audit")
    step, prev, old, _ = visits[0]
    pid = str(old.prompt_id.iloc[0])
    draft = [int(t) for t in old.token_ids.iloc[0]][:max(1, min(positions, sampling.max_new_tokens - 1))]
    prompt = [list(trace.prompts[pid])]
    ql = _next_token_logits(models.get(trace.checkpoint(prev)), prompt, [draft])[0]
    pl = _next_token_logits(models.get(trace.checkpoint(step)), prompt, [draft])[0]
    rows = []
    for t in range(len(draft)):
        q, p = processed_probs(ql[t], sampling), processed_probs(pl[t], sampling)
        q_r = torch.softmax(scaled_logits(ql[t], sampling).to(torch.float64), -1)
        p_r = torch.softmax(scaled_logits(pl[t], sampling).to(torch.float64), -1)
        exact = float(tv_distance(rule_distribution(q, p, lenience, q_r, p_r), p))
        mc, noise = monte_carlo_tv(q, p, lenience, samples, seed=t, q_ratio=q_r, p_ratio=p_r)
        rows.append({"step": step, "prompt_id": pid, "position": t, "tv_exact": exact, "tv_monte_carlo": mc,
                     "abs_diff": abs(mc - exact), "noise_scale": noise})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- reward delta on the engine

def replay_prefix_reuse(trace, steps: list[int], verify, dtype: str = "float64") -> pd.DataFrame:
    """Per-rollout rows of prefix reuse (draft = the slot's recorded previous visit) and the baseline
    on the engine: step, prompt_id, sample_idx, method, tokens, reward, accepted."""
    from bench.core.engine_protocol import Request
    from bench.engines.torch.engine import TorchRefEngine
    from bench.core.verify import VerifyConfig
    from methods.base import Rollout, RolloutKey
    from methods.baseline import Baseline
    from methods.prefix_reuse import PrefixReuseDrafter

    sampling = trace.sampling.to_config()
    engine = TorchRefEngine(dtype=dtype)
    rows = []
    for step, prev, old, new in previous_visits(trace, steps):
        drafter = PrefixReuseDrafter()
        for pid, idx, toks, lps in zip(old.prompt_id, old.sample_idx, old.token_ids, old.logprobs):
            key = RolloutKey(str(pid), int(idx))
            drafter.finish(key, Rollout(key, prev, list(trace.prompts[key.prompt_id]), [int(t) for t in toks],
                                        [float(x) for x in lps], "stop"))
        drafter.begin_step(step)
        engine.load(trace.checkpoint(step))
        reqs = [Request(RolloutKey(str(p), int(i)), list(trace.prompts[str(p)]), step)
                for p, i in zip(new.prompt_id, new.sample_idx) if drafter.has_previous(RolloutKey(str(p), int(i)))]
        for method, d, v in (("prefix_reuse", drafter, verify), ("baseline", Baseline(), VerifyConfig())):
            for r in engine.rollout(reqs, sampling, d, v):
                rows.append({"step": step, "prompt_id": r.key.prompt_id, "sample_idx": r.key.sample_idx,
                             "method": method, "token_ids": r.token_ids, "accepted": r.num_accepted_tokens,
                             "reward": trace.reward(r.key.prompt_id, r.token_ids) if trace.has_reward else float("nan")})
    engine.close()
    return pd.DataFrame(rows)


def reward_delta(replayed: pd.DataFrame) -> pd.DataFrame:
    """Per step and overall: mean reward of each method, the delta, and the token-identical fraction."""
    wide = replayed.pivot_table(index=["step", "prompt_id", "sample_idx"], columns="method",
                                values="reward", aggfunc="first")
    toks = replayed.set_index(["step", "prompt_id", "sample_idx", "method"])["token_ids"].map(tuple).unstack()
    wide["identical"] = toks["prefix_reuse"] == toks["baseline"]
    def agg(g):
        return pd.Series({"rollouts": len(g), "reward_mean_prefix_reuse": g["prefix_reuse"].mean(),
                          "reward_mean_baseline": g["baseline"].mean(),
                          "reward_delta": g["prefix_reuse"].mean() - g["baseline"].mean(),
                          "identical_frac": g["identical"].mean()})
    per_step = wide.groupby(level="step").apply(agg).reset_index()
    overall = agg(wide).to_frame().T.assign(step="all")
    return pd.concat([per_step.astype({"step": object}), overall[per_step.columns]], ignore_index=True)


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--lenience", type=float, default=SPEC_RL_GRPO_LENIENCE, help="l = exp(b); default e^0.5")
    ap.add_argument("--steps", type=int, nargs="*", help="steps to audit (default: all)")
    ap.add_argument("--mc-positions", type=int, default=3, help="positions of the Monte-Carlo check (0: skip)")
    ap.add_argument("--mc-samples", type=int, default=200_000)
    ap.add_argument("--no-reward", action="store_true", help="skip the engine replay for the reward delta")
    ap.add_argument("--out", type=Path, help="write the per-step bias table (.csv or .parquet)")
    args = ap.parse_args(argv)
    from bench.traces.format import Trace, TraceError
    from bench.core.verify import VerifyConfig
    try:
        trace = Trace.load(args.trace)
        verify = VerifyConfig("ratio", args.lenience)
    except (TraceError, ValueError) as exc:
        sys.exit(f"bench.benchmarks.bias: {exc}")
    steps = args.steps if args.steps else trace.step_numbers
    fmt = {"float_format": lambda x: f"{x:.4g}", "index": False}
    models = _Models()
    table = summarize_bias(audit_slots(trace, args.lenience, steps, models))
    print(f"ratio rule, lenience {args.lenience:.4g}: TV(rule, policy) per reached draft token")
    print(table.to_string(**fmt))
    if args.mc_positions > 0:
        print("\nMonte-Carlo check (exact vs sampled TV; |diff| should be within a few noise scales)")
        print(monte_carlo_check(trace, args.lenience, args.mc_positions, args.mc_samples, models).to_string(**fmt))
    if not args.no_reward:
        print("\nreward: prefix reuse (ratio rule) vs baseline on the engine, same steps and seed")
        print(reward_delta(replay_prefix_reuse(trace, steps, verify)).to_string(**fmt))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        (table.to_csv(args.out, index=False) if args.out.suffix == ".csv"
         else table.astype({"step": str}).to_parquet(args.out, index=False))


if __name__ == "__main__":
    main()
