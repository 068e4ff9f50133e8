"""Synthetic but self-consistent run folders for the results-layer tests (no model, no engine).

Rollouts are real ``methods.base.Rollout`` objects whose counters come from walking each rollout
through a simulated draft-and-verify loop, so every identity the metrics rely on holds: output
tokens = forward passes + accepted tokens, per-position counts decrease, exact methods emit the
baseline's tokens (same rewards), and the first step has no cache to draft from.
"""
from __future__ import annotations

import random
from pathlib import Path

from bench.report.results import RunWriter, rollout_row, step_row
from methods.base import Rollout, RolloutKey

# method -> (probability an iteration has a draft, per-token acceptance probability, draft length)
PROFILES = {"baseline": (0.0, 0.0, 0), "prefix_reuse": (0.35, 0.85, 24),
            "tree_cache": (0.9, 0.7, 8), "history_spec": (0.8, 0.6, 6)}
PASS_COST_S = {"torch_ref": 4e-3, "vllm": 1e-3, "sglang": 9e-4}  # seconds per engine iteration
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 48, "seed": 0}


def fake_rollouts(step: int, method: str, n_prompts: int = 4, n_samples: int = 2,
                  seed: int = 0, max_new_tokens: int = 48) -> list[Rollout]:
    draft_p, accept_p, k = PROFILES.get(method, (0.7, 0.65, 8))
    if step == 0:
        draft_p = 0.0  # nothing cached before the first step
    out = []
    for p in range(n_prompts):
        for s in range(n_samples):
            tok_rng = random.Random(f"{seed}-{step}-{p}-{s}")  # same tokens for every method
            length = tok_rng.randint(8, max_new_tokens)
            tokens = [tok_rng.randrange(3, 40) for _ in range(length)]
            rng = random.Random(f"{seed}-{step}-{p}-{s}-{method}")
            emitted = passes = drafts = accepted = 0
            per_pos = [0] * k
            while emitted < length:
                passes += 1
                if k and rng.random() < draft_p:
                    a = 0
                    while a < k and rng.random() < accept_p:
                        a += 1
                    a = min(a, length - emitted - 1)
                    drafts, accepted = drafts + 1, accepted + a
                    for i in range(a):
                        per_pos[i] += 1
                    emitted += a + 1
                else:
                    emitted += 1
            out.append(Rollout(
                key=RolloutKey(f"p{p}", s), step=step, prompt_token_ids=[1] * (5 + p),
                token_ids=tokens, logprobs=[-0.5 - 0.01 * t for t in tokens],
                finish_reason="length" if length == max_new_tokens else "stop",
                num_drafts=drafts, num_draft_tokens=drafts * k, num_accepted_tokens=accepted,
                num_accepted_tokens_per_pos=per_pos, num_forward_passes=passes,
                first_token_time=0.01, last_token_time=0.01 + 0.002 * passes))
    return out


def fake_reward(r: Rollout) -> float:
    return float(sum(r.token_ids) % 3 == 0)


def unit_rows(step: int, method: str, engine: str = "torch_ref", trace: str = "tiny",
              seed: int = 0, wall_scale: float = 1.0) -> tuple[list[dict], dict]:
    """(rollout rows, step row) of one (step, method) unit, as the replay harness would build them."""
    rollouts = fake_rollouts(step, method, seed=seed)
    ids = {"trace": trace, "engine": engine, "method": method}
    rows = [rollout_row(r, reward=fake_reward(r), matches_recorded=True, **ids) for r in rollouts]
    iterations = max(r.num_forward_passes for r in rollouts)  # batched: the longest rollout
    jitter = random.Random(f"wall-{seed}-{step}-{method}-{engine}").uniform(0.95, 1.05)
    wall = iterations * PASS_COST_S.get(engine, 2e-3) * wall_scale * jitter
    cached = method != "baseline" and step > 0
    stats = {"tree_nodes": 100.0 * step} if method == "tree_cache" else {}
    return rows, step_row(rows, wall, iterations, cache_entries=8 * step if cached else None,
                          cache_bytes=4096 * step if cached else None, drafter_stats=stats,
                          step=step, **ids)


def run_config(engine: str = "torch_ref", trace: str = "tiny", methods=("baseline", "tree_cache"),
               engine_settings: dict | None = None, rules: dict | None = None, **sampling) -> dict:
    """A run's config.yaml; ``rules`` ({method: verify rule}) adds the ``method`` section."""
    config = {"trace": {"name": trace}, "engine": {"name": engine, **(engine_settings or {})},
              "sampling": {**SAMPLING, **sampling}, "methods": list(methods)}
    if rules:
        config["method"] = {m: {"verify": {"rule": rules.get(m, "exact")}} for m in methods}
    return config


def write_fake_run(root: Path, run_id: str, engine: str = "torch_ref", trace: str = "tiny",
                   methods=("baseline", "tree_cache"), steps: int = 3, wall_scale: float = 1.0,
                   finish: bool = True, engine_settings: dict | None = None,
                   hardware: dict | None = None, rules: dict | None = None, **sampling) -> Path:
    """A complete run folder ``root/run_id`` with ``steps`` steps of each method; ``hardware``
    replaces this machine's in summary.json."""
    run_dir = Path(root) / run_id
    summary = {"trace": trace, **({"hardware": hardware} if hardware else {})}
    writer = RunWriter(run_dir, run_config(engine, trace, methods, engine_settings, rules, **sampling),
                       summary)
    for step in range(steps):
        for method in methods:
            rows, srow = unit_rows(step, method, engine, trace, wall_scale=wall_scale)
            writer.write_unit(step, method, rows, srow)
    if finish:
        writer.finish()
    return run_dir
