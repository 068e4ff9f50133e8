"""Honest low precision: every divergence from the baseline is a near-tie or a rule divergence.

Why this exists. Coupled sampling makes every exact method emit the baseline's tokens
(docs/design.md, "Coupled sampling"), but only up to floating point: a batched or tree-shaped forward differs from a
one-token forward in the last bits of the logits, and a token flips when its coupled uniform lies
within that difference of a CDF boundary. In float64 that never shows; in float32 it is about one
token in a million; in bf16 on a 2,048-token random policy most 128-token rollouts differ
somewhere. "Identity rate < 1" alone cannot tell such harmless flips from a broken verifier, so
every emitted token carries the **signed margin** of its uniform to its CDF interval
(``Rollout.margins``, ``bench.core.verify.token_margins``) and this module classifies the first
divergence of each (step, prompt_id, sample_idx) slot:

- ``near_tie``: the runs' distributions at that position differ by at most the dtype's
  measured CDF shift, so two tokens whose intervals are that close to u can trade places. For
  adjacent intervals the shift that moves the boundary across u is at least the sum of the two
  runs' margins, so a genuine flip has *both* margins below the shift; we require both below
  the threshold (stricter than "either", and still never met by a flip a wrong rule causes
  unless the wrong token happens to sit that close to u).
- ``rule_divergence``: anything else, in particular an emitted token whose margin in its own run
  is negative beyond the threshold (u does not select it: a draft token accepted by a wrong rule).
  For an exact method this must never happen.
- ``unknown``: margins missing (engines other than torch_ref, run folders written before margins).

Thresholds (:func:`near_tie_threshold`) come from ``python -m bench.benchmarks near-ties``, which
measures the largest shift of the normalised CDF between a batched/tree forward and one-token
forwards on a random policy with a 2,048-token vocabulary, per dtype (results/LOG.md, 2026-12-01).
"""
from __future__ import annotations

import math
from typing import Sequence

import pandas as pd

# About 10x the largest CDF shift measured by ``python -m bench.benchmarks near-ties`` (vocab
# 2048; hidden x layers 64x2, 256x4, 512x8; batched chain and tree forwards vs one-token
# forwards, CPU), rounded up to 1, 2 or 5 x a power of ten. Max shifts at 512x8: float32 1.2e-7,
# float16 2.7e-4, bfloat16 1.0e-3 (fp32 output layer). float64 showed none (1e-12 leaves room
# for rounding at 1e-16). The shift grows with model size (bf16: 8.7e-5 at 64x2, 1.0e-3 at
# 512x8), so for a large policy re-measure with --hidden/--layers (or on its real weights) and
# pass a threshold of your own. See results/LOG.md, 2026-12-01.
NEAR_TIE_THRESHOLDS = {"float64": 1e-12, "float32": 2e-6, "bfloat16": 2e-2, "float16": 5e-3}

OUTCOMES = ("identical", "near_tie", "rule_divergence", "unknown")
SLOT = ["step", "prompt_id", "sample_idx"]


def near_tie_threshold(dtype: str) -> float:
    """The margin (probability mass) below which a divergence in a run of this engine dtype is a
    near-tie: float64 / float32 / bfloat16 / float16 (a torch dtype's str, e.g. "torch.bfloat16",
    works too). Raises ValueError on any other name."""
    name = str(dtype).removeprefix("torch.")
    if name not in NEAR_TIE_THRESHOLDS:
        raise ValueError(f"no near-tie threshold for dtype {dtype!r}; known: {sorted(NEAR_TIE_THRESHOLDS)}")
    return NEAR_TIE_THRESHOLDS[name]


def _margin_at(margins: Sequence[float] | None, t: int) -> float | None:
    if margins is None or t >= len(margins):
        return None
    m = float(margins[t])
    return None if math.isnan(m) else m


def classify(method_tokens: Sequence[int], method_margins: Sequence[float] | None,
             base_tokens: Sequence[int], base_margins: Sequence[float] | None,
             threshold: float) -> tuple[str, int | None]:
    """Classify one slot of a method run against the same slot of the baseline run.

    Returns (outcome, t): outcome is "identical", "near_tie", "rule_divergence" or "unknown"
    (a margin at t is missing), t the first position where the token lists differ (None when
    identical; when one list is a prefix of the other, t is the shorter length). At t the
    method's margin is m, the baseline's b: m < -threshold -> rule divergence; |m| < threshold
    and |b| < threshold -> near-tie; else rule divergence.

    Example: classify([5, 7], [0.3, 1e-4], [5, 8], [0.3, 2e-4], 1e-3) -> ("near_tie", 1).
    """
    a, b = [int(x) for x in method_tokens], [int(x) for x in base_tokens]
    if a == b:
        return "identical", None
    t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    m, mb = _margin_at(method_margins, t), _margin_at(base_margins, t)
    if m is None and t < len(a) or mb is None and t < len(b):
        return "unknown", t
    if m is not None and m < -threshold:
        return "rule_divergence", t
    near = all(abs(x) < threshold for x in (m, mb) if x is not None)
    return ("near_tie" if near else "rule_divergence"), t


def divergence_summary(method_rows: pd.DataFrame, baseline_rows: pd.DataFrame, threshold: float) -> dict:
    """Identity of a method's rollouts to the baseline's, with every divergence classified.

    Rows are rollouts.parquet rows (columns step, prompt_id, sample_idx, output_tokens, margins,
    run_ahead; a missing margins column means margins are missing). Run-ahead rows are ignored;
    slots are matched on (step, prompt_id, sample_idx) and only slots in both frames count.
    Returns {"compared": slots matched, "identity_rate": identical / compared (nan if none),
    "near_ties": int, "rule_divergences": int}; the two counts are None when some divergence
    could not be classified (margins missing), and 0 when nothing diverged.
    """
    def prep(df: pd.DataFrame) -> pd.DataFrame:
        if "run_ahead" in df:
            df = df[~df["run_ahead"].fillna(False).astype(bool)]
        cols = SLOT + ["output_tokens"] + (["margins"] if "margins" in df else [])
        out = df[cols].copy()
        if "margins" not in out:
            out["margins"] = None
        out["prompt_id"] = out["prompt_id"].astype(str)
        out["step"] = out["step"].astype("int64")
        out["sample_idx"] = out["sample_idx"].astype("int64")
        return out

    joined = prep(method_rows).merge(prep(baseline_rows), on=SLOT, suffixes=("_m", "_b"))
    counts = dict.fromkeys(OUTCOMES, 0)
    for tm, mm, tb, mb in zip(joined["output_tokens_m"], joined["margins_m"], joined["output_tokens_b"],
                              joined["margins_b"]):
        counts[classify(tm, _as_list(mm), tb, _as_list(mb), threshold)[0]] += 1
    compared = len(joined)
    classified = counts["unknown"] == 0
    return {"compared": compared,
            "identity_rate": counts["identical"] / compared if compared else float("nan"),
            "near_ties": counts["near_tie"] if classified else None,
            "rule_divergences": counts["rule_divergence"] if classified else None}


def _as_list(margins) -> list[float] | None:
    """A parquet cell (array, list or None/NaN) as a list; an empty list counts as missing."""
    if margins is None or isinstance(margins, float):
        return None
    out = [float(x) for x in margins]
    return out or None
