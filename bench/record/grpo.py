"""The GRPO recorder: SFT warm start, then GRPO steps whose checkpoints and rollouts form a trace.

    python -m bench.record --out traces/countdown-tiny --tiny

Rollouts are sampled by the torch reference engine with the baseline drafter and coupled sampling
under the recorder's seed, so a baseline replay of the trace reproduces them token for token.
Each step: save the live policy as the step's checkpoint, sample n rollouts per prompt, score them,
then train on them (GRPO advantages, clipped policy gradient, engine logprobs as old logprobs).
"""
from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from ..trace import TraceSampling, TraceWriter, checkpoint_relpath
from . import task as countdown
from .model import ModelConfig, build_model, save_checkpoint
from .sft import SFTConfig, sft
from .tokenizer import build_tokenizer

RECORDER_VERSION = 1


@dataclass
class RecordConfig:
    name: str = "countdown"
    steps: int = 32
    num_prompts: int = 64
    prompts_per_step: int = 16  # an epoch is num_prompts / prompts_per_step steps
    n: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    sft_steps: int = 250  # partly trained: about 1 in 8 answers correct at temperature 1
    lr: float = 3e-4  # 1e-3 destabilised the policy (lengths blew up, reward fell)
    grad_steps: int = 2  # gradient steps per batch (the first is on-policy, ratio 1)
    clip: float = 0.2
    eps: float = 1e-6

    @classmethod
    def tiny(cls, **kw) -> "RecordConfig":
        """A trace small enough for tests: 3 visits of each of 8 prompts."""
        return replace(cls(name="countdown-tiny", steps=6, num_prompts=8, prompts_per_step=4, n=4,
                           max_new_tokens=16, sft_steps=120), **kw)

    def __post_init__(self) -> None:
        if self.num_prompts % self.prompts_per_step:
            raise ValueError(f"num_prompts {self.num_prompts} must be a multiple of prompts_per_step "
                             f"{self.prompts_per_step} (each epoch visits every prompt once)")


def step_prompts(prompt_ids: list[str], cfg: RecordConfig, step: int) -> list[str]:
    """The prompts of a step: every epoch visits all prompts once, in a seeded shuffled order."""
    per_epoch = cfg.num_prompts // cfg.prompts_per_step
    epoch, pos = divmod(step, per_epoch)
    order = list(prompt_ids)
    random.Random(cfg.seed * 1_000_003 + epoch).shuffle(order)
    return order[pos * cfg.prompts_per_step:(pos + 1) * cfg.prompts_per_step]


def response_ids(token_ids: list[int], eos_id: int) -> list[int]:
    return token_ids[:token_ids.index(eos_id)] if eos_id in token_ids else list(token_ids)


def grpo_update(model, opt, batch: list[tuple[list[int], list[int], list[float], float]],
                cfg: RecordConfig) -> float:
    """Clipped policy-gradient steps on (prompt, response, old logprobs, advantage) rows."""
    rows = [b for b in batch if b[3] != 0.0 and b[1]]
    if not rows:
        return 0.0
    width = max(len(p) + len(r) for p, r, _, _ in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros((len(rows), width), dtype=torch.bool)  # True where a response token is predicted
    old = torch.zeros((len(rows), width))
    adv = torch.tensor([a for _, _, _, a in rows])
    for i, (p, r, lp, _) in enumerate(rows):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        attn[i, :len(p) + len(r)] = 1
        resp[i, len(p) - 1:len(p) + len(r) - 1] = True  # logits at t predict token t + 1
        old[i, len(p) - 1:len(p) + len(r) - 1] = torch.tensor(lp)
    model.train()
    loss_value = 0.0
    for _ in range(cfg.grad_steps):
        logits = model(input_ids=ids, attention_mask=attn).logits.float()  # [B, T, V]
        logp = torch.log_softmax(logits / max(cfg.temperature, 1e-6), -1)
        target = torch.roll(ids, -1, dims=1)
        new = logp.gather(-1, target[..., None])[..., 0]  # [B, T]
        ratio = torch.exp(torch.where(resp, new - old, torch.zeros_like(new)))
        a = adv[:, None]
        obj = torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * a)
        per_seq = (obj * resp).sum(1) / resp.sum(1).clamp(min=1)
        loss = -per_seq.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = loss.item()
    model.eval()
    return loss_value


def _p90(xs: list[int]) -> float:
    return float(sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))])


def record(out: Path, cfg: RecordConfig | None = None, progress: bool = True, threads: int = 1) -> Path:
    """Record a trace into ``out`` (created; must not hold a trace yet). Returns ``out``.

    ``threads``: torch CPU threads while recording (restored after). One is the fastest on a
    shared small machine (several threads spin against other processes) and deterministic.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _record(Path(out), cfg or RecordConfig(), progress)
    finally:
        torch.set_num_threads(previous)


def _record(out: Path, cfg: RecordConfig, progress: bool) -> Path:
    from bench.engines.base import Request
    from bench.engines.torch_ref import TorchRefEngine
    from bench.verify import VerifyConfig
    from methods.base import RolloutKey
    from methods.baseline import Baseline
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t_start = time.perf_counter()
    tok = build_tokenizer()
    sampling = TraceSampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens, cfg.n, cfg.seed)
    writer = TraceWriter(out, cfg.name, sampling, vocab_size=len(tok), task=countdown.NAME,
                         extra={"recorder": {"version": RECORDER_VERSION, **asdict(cfg)}})
    tok.save_pretrained(str(out / writer.tokenizer))
    problems = countdown.make_problems(cfg.num_prompts, seed=cfg.seed + 17)
    pids = [f"p{i:04d}" for i in range(len(problems))]
    prompt_tokens = {pid: tok(p.prompt)["input_ids"] for pid, p in zip(pids, problems)}
    by_pid = dict(zip(pids, problems))
    writer.write_prompts([{"prompt_id": pid, "token_ids": prompt_tokens[pid], "text": p.prompt,
                           **p.metadata()} for pid, p in by_pid.items()])

    model = build_model(tok, ModelConfig(), seed=cfg.seed)
    sft_losses = sft(model, tok, SFTConfig(steps=cfg.sft_steps, seed=cfg.seed), progress=progress)
    t_sft = time.perf_counter() - t_start
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    engine = TorchRefEngine(device="cpu", dtype="float32")
    sampling_cfg = sampling.to_config()
    last_visit: dict[str, list[list[int]]] = {}
    stats: list[dict] = []
    bar = tqdm(range(cfg.steps), desc="grpo", disable=not progress)
    for step in bar:
        t0 = time.perf_counter()
        rel = checkpoint_relpath(step)
        save_checkpoint(model, tok, out / rel)
        engine.load(out / rel)
        batch_pids = step_prompts(pids, cfg, step)
        requests = [Request(RolloutKey(pid, i), prompt_tokens[pid], step=step)
                    for pid in batch_pids for i in range(cfg.n)]
        rollouts = engine.rollout(requests, sampling_cfg, Baseline(), VerifyConfig())
        t1 = time.perf_counter()
        rewards = [countdown.reward(by_pid[r.key.prompt_id],
                                    tok.decode(response_ids(r.token_ids, tok.eos_token_id)))
                   for r in rollouts]
        df = pd.DataFrame({"prompt_id": [r.key.prompt_id for r in rollouts],
                           "sample_idx": [r.key.sample_idx for r in rollouts],
                           "token_ids": [list(r.token_ids) for r in rollouts],
                           "logprobs": [list(r.logprobs) for r in rollouts],
                           "reward": rewards,
                           "finish_reason": [r.finish_reason for r in rollouts]})
        writer.add_step(step, rel, batch_pids, writer.write_rollouts(step, df))

        repeats = [r.token_ids == last_visit[r.key.prompt_id][r.key.sample_idx]
                   for r in rollouts if r.key.prompt_id in last_visit]
        for pid in batch_pids:
            last_visit[pid] = [r.token_ids for r in rollouts if r.key.prompt_id == pid]
        lengths = [len(r.token_ids) for r in rollouts]
        groups = [rewards[g:g + cfg.n] for g in range(0, len(rewards), cfg.n)]
        advantages = []
        for g in groups:
            mean, std = statistics.mean(g), statistics.pstdev(g)
            advantages += [(x - mean) / (std + cfg.eps) for x in g]
        loss = 0.0
        if step < cfg.steps - 1:  # the last step's rollouts train nothing that is recorded
            loss = grpo_update(model, opt, [(r.prompt_token_ids, list(r.token_ids), list(r.logprobs), a)
                                            for r, a in zip(rollouts, advantages)], cfg)
        row = {"step": step, "reward_mean": statistics.mean(rewards),
               "correct_frac": statistics.mean(x == countdown.REWARD_CORRECT for x in rewards),
               "length_mean": statistics.mean(lengths), "length_p90": _p90(lengths),
               "truncated_frac": statistics.mean(r.finish_reason == "length" for r in rollouts),
               "distinct_frac": statistics.mean(len({tuple(rollouts[g + i].token_ids) for i in range(cfg.n)})
                                                / cfg.n for g in range(0, len(rollouts), cfg.n)),
               "repeat_frac": statistics.mean(repeats) if repeats else None,
               "loss": loss, "rollout_s": t1 - t0, "step_s": time.perf_counter() - t0}
        stats.append(row)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", len=f"{row['length_mean']:.1f}")
        if progress:
            tqdm.write(format_row(row))
    summary = {"config": asdict(cfg), "sft_s": t_sft, "sft_final_loss": statistics.mean(sft_losses[-10:]),
               "wall_s": time.perf_counter() - t_start, "steps": stats}
    (out / "stats.json").write_text(json.dumps(summary, indent=1))
    engine.close()
    return out


def format_row(row: dict) -> str:
    rep = "  -  " if row["repeat_frac"] is None else f"{row['repeat_frac']:.3f}"
    return (f"step {row['step']:3d}  reward {row['reward_mean']:.3f}  correct {row['correct_frac']:.3f}  "
            f"len {row['length_mean']:5.2f} (p90 {row['length_p90']:.0f})  distinct {row['distinct_frac']:.2f}  "
            f"repeat {rep}  {row['step_s']:.1f}s")
