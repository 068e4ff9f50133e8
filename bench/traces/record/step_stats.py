"""What the recorder reports of each GRPO step's rollouts: reward, lengths, repeats and n-gram reuse.

The recorder (``bench.traces.record.grpo``) computes one row per step with :func:`step_row` (and
:class:`RolloutHistory` for how much of a step repeats its prompts' earlier rollouts), prints it
with :func:`format_row`, and writes the rows with the trace's :func:`length_summary` to its
``stats.json``. Kept apart from the recording loop: these numbers describe a trace, they do not
make it.

    python -m bench.traces.record --out DIR --tiny     # prints a format_row line per step
    python -m pytest -q tests/test_record.py           # the rows of a recorded trace
"""
from __future__ import annotations

import statistics

from bench.traces.record import task as countdown


def _quantile(xs: list[int], q: float) -> float:
    return float(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))])


def ngrams(ids, n: int = 8) -> list[tuple[int, ...]]:
    return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]


def _p90(xs: list[int]) -> float:
    return float(sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))])


class RolloutHistory:
    """Each prompt's rollouts at its last visit and the 8-grams of all its earlier rollouts: what
    a step's rollouts are compared with."""

    def __init__(self) -> None:
        self.last_visit: dict[str, list[list[int]]] = {}
        self.seen_ngrams: dict[str, set] = {}  # prompt -> 8-grams of its rollouts at earlier steps

    def observe(self, rollouts, batch_pids: list[str]) -> tuple[list[bool], list[float]]:
        """(per rollout of a revisited prompt: whether it equals the same sample at the last visit;
        per rollout of a prompt seen before: the share of its 8-grams already in the prompt's
        earlier rollouts), then remember this step's rollouts."""
        repeats = [r.token_ids == self.last_visit[r.key.prompt_id][r.key.sample_idx]
                   for r in rollouts if r.key.prompt_id in self.last_visit]
        for pid in batch_pids:
            self.last_visit[pid] = [r.token_ids for r in rollouts if r.key.prompt_id == pid]
        shares = []
        for r in rollouts:
            grams = ngrams(r.token_ids)
            if grams and r.key.prompt_id in self.seen_ngrams:
                seen = self.seen_ngrams[r.key.prompt_id]
                shares.append(sum(g in seen for g in grams) / len(grams))
        for r in rollouts:
            self.seen_ngrams.setdefault(r.key.prompt_id, set()).update(ngrams(r.token_ids))
        return repeats, shares


def step_row(step: int, rollouts, rewards: list[float], n: int, repeats: list[bool], shares: list[float],
             checkpoint: bool, loss: float, rollout_s: float, step_s: float) -> dict:
    """One step's row of ``stats.json`` (``_lengths``: its response lengths, dropped there after
    the trace's :func:`length_summary` has read them)."""
    lengths = [len(r.token_ids) for r in rollouts]
    return {"step": step, "reward_mean": statistics.mean(rewards),
            "correct_frac": statistics.mean(x == countdown.REWARD_CORRECT for x in rewards),
            "length_mean": statistics.mean(lengths), "length_p50": _quantile(lengths, 0.5),
            "length_p90": _p90(lengths), "length_p99": _quantile(lengths, 0.99),
            "length_max": max(lengths), "checkpoint": checkpoint,
            "ngram8_seen_frac": statistics.mean(shares) if shares else None,
            "truncated_frac": statistics.mean(r.finish_reason == "length" for r in rollouts),
            "distinct_frac": statistics.mean(len({tuple(rollouts[g + i].token_ids) for i in range(n)})
                                             / n for g in range(0, len(rollouts), n)),
            "repeat_frac": statistics.mean(repeats) if repeats else None,
            "loss": loss, "rollout_s": rollout_s, "step_s": step_s,
            "_lengths": lengths}


def length_summary(lengths: list[int]) -> dict:
    """Response lengths of the whole trace: mean, p50, p90, p99, max, and p99 / p50."""
    q = {f"p{int(f * 100)}": _quantile(lengths, f) for f in (0.5, 0.9, 0.99)}
    return {"mean": statistics.mean(lengths), **q, "max": max(lengths), "p99_over_p50": q["p99"] / q["p50"]}


def format_row(row: dict) -> str:
    rep = "  -  " if row["repeat_frac"] is None else f"{row['repeat_frac']:.3f}"
    seen = row.get("ngram8_seen_frac")
    tail = "" if "length_p50" not in row else (
        f" p50 {row['length_p50']:.0f} p99 {row['length_p99']:.0f} max {row['length_max']}  8-gram seen "
        + ("  -  " if seen is None else f"{seen:.3f}"))
    return (f"step {row['step']:3d}  reward {row['reward_mean']:.3f}  correct {row['correct_frac']:.3f}  "
            f"len {row['length_mean']:5.2f} (p90 {row['length_p90']:.0f}){tail}  distinct {row['distinct_frac']:.2f}  "
            f"repeat {rep}  {row['step_s']:.1f}s")
