"""A synthetic run log shaped like a real one, for checks of the simulator at scale and for tests
that need many long rollouts without a model.

    python -m bench.benchmarks simulate-scale                  # the simulator on such a log
    pytest tests/test_simulate.py -k synthetic                 # the cache oracle's bound on one

``synthetic_log`` builds the rollouts in memory; ``write_log`` writes them as the folder of
per-step run logs that ``python -m bench.harness.simulate LOG_DIR`` reads.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import pandas as pd


def synthetic_log(steps: int = 8, prompts: int = 16, samples: int = 8, max_len: int = 4096,
                  vocab: int = 151_936, median_len: int = 2048, event_rate: float = 0.03,
                  drift: float = 0.01, prompt_len: int = 128, eos: int = 2,
                  seed: int = 0) -> tuple[dict[int, pd.DataFrame], dict[str, list[int]]]:
    """A run log shaped like a real one, for scale checks: (rollouts by step, prompts).

    Every step visits the same ``prompts`` prompts with ``samples`` rollouts each (a GRPO group).
    Each prompt has a template (Zipf-distributed token ids over ``vocab``, twice ``max_len`` long)
    that drifts by ``drift`` substitutions per token and step (the policy moves); a rollout copies
    its template from the start and, at events of rate ``event_rate`` per token, substitutes a
    token, inserts 1-8 fresh ones, or jumps up to 64 tokens back or ahead, so rollouts of one
    prompt share long stretches (about 1 / event_rate tokens) with each other and with earlier
    steps, and rollouts of different prompts share only frequent tokens. Lengths are long-tailed:
    a per-prompt median (``median_len`` x lognormal(0, 0.5)) times lognormal(0, 0.5) per rollout,
    cut at ``max_len`` (finish_reason ``length``; the others end with ``eos``).
    """
    import numpy as np
    rng = np.random.default_rng(seed)
    perm = rng.permutation(vocab).astype(np.int32)
    zipf = lambda n: perm[(rng.zipf(1.2, n) - 1) % vocab]
    names = [f"p{i}" for i in range(prompts)]
    prompt_ids = {p: [int(t) for t in zipf(prompt_len)] for p in names}
    templates = {p: zipf(2 * max_len) for p in names}
    medians = {p: median_len * rng.lognormal(0.0, 0.5) for p in names}
    out = {}
    for step in range(steps):
        rows = []
        for p in names:
            tpl = templates[p]
            hit = rng.random(len(tpl)) < drift
            tpl[hit] = zipf(int(hit.sum()))
            for i in range(samples):
                n = int(min(max_len, max(16, medians[p] * rng.lognormal(0.0, 0.5))))
                parts, have, pos = [], 0, int(rng.integers(0, 16))
                while have < n:
                    take = min(int(rng.geometric(event_rate)), n - have)
                    parts.append(tpl[(pos + np.arange(take)) % len(tpl)])
                    pos, have = pos + take, have + take
                    r = rng.random()
                    if r < 0.5:  # substitution
                        parts.append(zipf(1))
                        pos, have = pos + 1, have + 1
                    elif r < 0.75:  # insertion
                        k = int(rng.integers(1, 9))
                        parts.append(zipf(k))
                        have += k
                    else:  # a jump: a stretch skipped or repeated
                        pos = max(0, pos + int(rng.integers(-64, 65)))
                toks = np.concatenate(parts)[:n]
                if n < max_len:
                    toks[-1] = eos
                rows.append((p, i, toks, prompt_ids[p], "length" if n >= max_len else "stop"))
        out[step] = pd.DataFrame(rows, columns=["prompt_id", "sample_idx", "token_ids", "prompt_token_ids",
                                                "finish_reason"])
    return out, prompt_ids


def write_log(steps: Mapping[int, pd.DataFrame], out_dir: str | Path) -> Path:
    """A folder of run logs (``step_<N>.parquet``) that ``bench.harness.sim_inputs.load_input`` reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for step, df in steps.items():
        df.to_parquet(out / f"step_{step:05d}.parquet", index=False)
    return out
