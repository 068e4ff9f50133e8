"""The GRPO recorder: SFT warm start, then GRPO steps whose checkpoints and rollouts form a trace.

    python -m bench.traces.record --out traces/countdown-tiny --tiny

Rollouts are sampled by the torch reference engine with the baseline drafter and coupled sampling
under the recorder's seed, so a baseline replay of the trace reproduces them token for token.
Each step: save the live policy as the step's checkpoint, sample n rollouts per prompt, score them,
then train on them (GRPO advantages, clipped policy gradient, engine logprobs as old logprobs).
"""
from __future__ import annotations

import json
import random
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from bench.traces.format import TraceSampling, TraceWriter, checkpoint_relpath
from bench.traces.record import search_task
from bench.traces.record import task as countdown
from bench.traces.record.model import ModelConfig, build_model, save_checkpoint
from bench.traces.record.sft import SFTConfig, sft
from bench.traces.record.tokenizer import build_tokenizer

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

    # The short task's recipe; SearchRecordConfig overrides these hooks.
    task_module = countdown

    def has_checkpoint(self, step: int) -> bool:
        return True

    def build_tokenizer(self):
        return build_tokenizer()

    def model_config(self) -> ModelConfig:
        return ModelConfig()

    def sft_config(self) -> SFTConfig:
        return SFTConfig(steps=self.sft_steps, seed=self.seed)

    def sft_batches(self, tokenizer):
        return None  # the short task's own examples (bench.traces.record.sft)


@dataclass
class SearchRecordConfig(RecordConfig):
    """The long-tailed reasoning trace: Countdown solved by a written-out search
    (``bench.traces.record.search_task``), a BPE tokenizer trained on the task's text, max 640 new tokens.

    Checkpoints are sparse (``checkpoint_every``, ``checkpoint_last``): every step's rollouts are
    recorded, only some steps keep their policy, as in a real run; a replay runs those and feeds
    the rollouts in between to the drafters. The SFT warm start (1,200 steps) takes 10-20 minutes
    on one core, so the trace recorded with these defaults ships in the package
    (``bench.traces.record.cache.BUNDLED``) and is copied, not recorded, on first use.
    """

    name: str = "countdown-search"
    steps: int = 80  # 20 visits of each prompt (at 40 the reward rose +0.066, at 80 +0.113: results/LOG.md)
    num_prompts: int = 32
    prompts_per_step: int = 8
    max_new_tokens: int = 640
    sft_steps: int = 1200
    sft_batch_size: int = 16
    sft_lr: float = 3e-3
    lr: float = 2e-4  # 6e-4 raised the reward for 10 steps, then lost it and looped to the length cap
    grad_steps: int = 1
    vocab_size: int = 384
    digits_apart: bool = True  # numbers are the same token after a space or not (bench.traces.record.bpe_tokenizer)
    hidden_size: int = 128
    num_hidden_layers: int = 2
    intermediate_size: int = 256
    four_share: float = 0.3  # share of four-number problems (the long searches)
    min_paths: int = 2  # targets reached by at least 2 search paths
    max_lines: int = 80  # the solver gives up after this many lines
    restate_path: bool = True  # lines below the first level start with the path to their state
    max_chars: int = 690  # ... or past this many characters (about 600 tokens; 0: max_lines only)
    verdict_first: bool = True  # "6+3=9 == 9" / "... != 9": the verdict right after the value it judges
    max_number: int = 5  # the given numbers are 1..max_number (small facts: a tiny policy learns them)
    ops: str = "+-*"  # the operations the solver tries
    micro_batch_tokens: int = 8192  # GRPO update micro-batches (padded tokens), sorted by length
    checkpoint_every: int = 2
    checkpoint_last: int = 2  # keep only this many checkpoints, counted back from the last step (0: all)

    @classmethod
    def tiny(cls, **kw) -> "SearchRecordConfig":
        """A small search trace for tests: 4 steps, 4 prompts, n 4, max 96 new tokens."""
        return replace(cls(name="countdown-search-tiny", steps=4, num_prompts=4, prompts_per_step=2, n=4,
                           max_new_tokens=96, sft_steps=40, checkpoint_every=2), **kw)

    task_module = search_task

    def has_checkpoint(self, step: int) -> bool:
        back = self.steps - 1 - step
        if back % max(1, self.checkpoint_every):
            return False
        return not self.checkpoint_last or back // max(1, self.checkpoint_every) < self.checkpoint_last

    def _sft_problems(self):
        return search_task.make_problems(2000, seed=self.seed + 1_000_003, four_share=self.four_share,
                                         min_paths=self.min_paths, max_number=self.max_number, ops=self.ops)

    def build_tokenizer(self):
        from bench.traces.record.bpe_tokenizer import train_tokenizer
        texts = search_task.corpus(self._sft_problems()[:600], seed=self.seed, max_lines=self.max_lines,
                                   ops=self.ops, restate_path=self.restate_path, max_chars=self.max_chars,
                                   verdict_first=self.verdict_first)
        return train_tokenizer(texts, self.vocab_size, digits_apart=self.digits_apart)

    def model_config(self) -> ModelConfig:
        return ModelConfig(hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.hidden_size // 64, head_dim=64,
                           intermediate_size=self.intermediate_size,
                           max_position_embeddings=self.max_new_tokens + 128)

    def sft_config(self) -> SFTConfig:
        return SFTConfig(steps=self.sft_steps, batch_size=self.sft_batch_size, lr=self.sft_lr, seed=self.seed,
                         decay=True)

    def sft_batches(self, tokenizer):
        """Batches of fresh random-order searches, bucketed by length (four batches per pool) so
        little of each batch is padding."""
        problems, queue = self._sft_problems(), []
        eos, cap = tokenizer.eos_token_id, self.max_new_tokens

        def make_batch(rng: random.Random):
            if not queue:
                pool = []
                for _ in range(4 * self.sft_batch_size):
                    p = problems[rng.randrange(len(problems))]
                    prompt = tokenizer(p.prompt)["input_ids"]
                    answer = tokenizer(search_task.sft_example(p, rng, self.max_lines, self.ops,
                                                               self.restate_path, self.max_chars,
                                                               self.verdict_first),
                                       add_special_tokens=False)["input_ids"][:cap - 1]
                    pool.append((prompt + answer + [eos], len(prompt)))
                pool.sort(key=lambda e: len(e[0]))
                queue.extend(pool[i:i + self.sft_batch_size] for i in range(0, len(pool), self.sft_batch_size))
                rng.shuffle(queue)
            return queue.pop()
        return make_batch


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
    budget = getattr(cfg, "micro_batch_tokens", 0)
    if budget:
        return _micro_batched_update(model, opt, rows, cfg, budget)
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


def _tensors(rows):
    width = max(len(p) + len(r) for p, r, _, _ in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros((len(rows), width), dtype=torch.bool)
    old = torch.zeros((len(rows), width))
    for i, (p, r, lp, _) in enumerate(rows):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        attn[i, :len(p) + len(r)] = 1
        resp[i, len(p) - 1:len(p) + len(r) - 1] = True
        old[i, len(p) - 1:len(p) + len(r) - 1] = torch.tensor(lp)
    return ids, attn, resp, old, torch.tensor([a for _, _, _, a in rows])


def _micro_batched_update(model, opt, rows, cfg, budget: int) -> float:
    """``grpo_update`` over length-sorted micro-batches of at most ``budget`` padded tokens
    (gradients accumulated, one optimizer step per gradient step): long rollouts, little padding."""
    rows = sorted(rows, key=lambda b: len(b[0]) + len(b[1]))
    chunks, cur = [], []
    for b in rows:
        width = len(b[0]) + len(b[1])  # the longest so far (sorted)
        if cur and width * (len(cur) + 1) > budget:
            chunks.append(cur)
            cur = []
        cur.append(b)
    chunks.append(cur)
    tensors = [_tensors(c) for c in chunks]
    model.train()
    loss_value = 0.0
    for _ in range(cfg.grad_steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for (ids, attn, resp, old, adv), c in zip(tensors, chunks):
            logits = model(input_ids=ids, attention_mask=attn).logits.float()
            logp = torch.log_softmax(logits / max(cfg.temperature, 1e-6), -1)
            new = logp.gather(-1, torch.roll(ids, -1, dims=1)[..., None])[..., 0]
            ratio = torch.exp(torch.where(resp, new - old, torch.zeros_like(new)))
            a = adv[:, None]
            obj = torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * a)
            per_seq = (obj * resp).sum(1) / resp.sum(1).clamp(min=1)
            loss = -per_seq.sum() / len(rows)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = total
    model.eval()
    return loss_value


def _quantile(xs: list[int], q: float) -> float:
    return float(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))])


def ngrams(ids, n: int = 8) -> list[tuple[int, ...]]:
    return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]


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
        with torch.enable_grad():  # a caller may have turned gradients off (the benchmarks do)
            return _record(Path(out), cfg or RecordConfig(), progress)
    finally:
        torch.set_num_threads(previous)


def _record(out: Path, cfg: RecordConfig, progress: bool) -> Path:
    from bench.core.engine_protocol import Request
    from bench.engines.torch.engine import TorchRefEngine
    from bench.core.verify import VerifyConfig
    from methods.base import RolloutKey
    from methods.baseline import Baseline
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t_start = time.perf_counter()
    task = cfg.task_module
    tok = cfg.build_tokenizer()
    sampling = TraceSampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens, cfg.n, cfg.seed)
    writer = TraceWriter(out, cfg.name, sampling, vocab_size=len(tok), task=task.NAME,
                         extra={"recorder": {"version": RECORDER_VERSION, **asdict(cfg)}})
    tok.save_pretrained(str(out / writer.tokenizer))
    if task is countdown:
        problems = countdown.make_problems(cfg.num_prompts, seed=cfg.seed + 17)
    else:
        problems = task.make_problems(cfg.num_prompts, seed=cfg.seed + 17, four_share=cfg.four_share,
                                      min_paths=cfg.min_paths, max_number=cfg.max_number, ops=cfg.ops)
    pids = [f"p{i:04d}" for i in range(len(problems))]
    prompt_tokens = {pid: tok(p.prompt)["input_ids"] for pid, p in zip(pids, problems)}
    by_pid = dict(zip(pids, problems))
    writer.write_prompts([{"prompt_id": pid, "token_ids": prompt_tokens[pid], "text": p.prompt,
                           **p.metadata()} for pid, p in by_pid.items()])

    model = build_model(tok, cfg.model_config(), seed=cfg.seed)
    sft_losses = sft(model, tok, cfg.sft_config(), progress=progress, make_batch=cfg.sft_batches(tok))
    t_sft = time.perf_counter() - t_start
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    engine = TorchRefEngine(device="cpu", dtype="float32")
    sampling_cfg = sampling.to_config()
    last_visit: dict[str, list[list[int]]] = {}
    seen_ngrams: dict[str, set] = {}  # prompt -> 8-grams of its rollouts at earlier steps
    scratch = out / ".policy"  # the live policy of a step that keeps no checkpoint
    stats: list[dict] = []
    bar = tqdm(range(cfg.steps), desc="grpo", disable=not progress)
    for step in bar:
        t0 = time.perf_counter()
        rel = checkpoint_relpath(step) if cfg.has_checkpoint(step) else None
        save_checkpoint(model, tok, out / rel if rel else scratch)
        engine.load(out / rel if rel else scratch)
        batch_pids = step_prompts(pids, cfg, step)
        requests = [Request(RolloutKey(pid, i), prompt_tokens[pid], step=step)
                    for pid in batch_pids for i in range(cfg.n)]
        rollouts = engine.rollout(requests, sampling_cfg, Baseline(), VerifyConfig())
        t1 = time.perf_counter()
        rewards = [task.reward(by_pid[r.key.prompt_id],
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
        shares = []  # per rollout: share of its 8-grams already in its prompt's earlier rollouts
        for r in rollouts:
            grams = ngrams(r.token_ids)
            if grams and r.key.prompt_id in seen_ngrams:
                seen = seen_ngrams[r.key.prompt_id]
                shares.append(sum(g in seen for g in grams) / len(grams))
        for r in rollouts:
            seen_ngrams.setdefault(r.key.prompt_id, set()).update(ngrams(r.token_ids))
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
               "length_mean": statistics.mean(lengths), "length_p50": _quantile(lengths, 0.5),
               "length_p90": _p90(lengths), "length_p99": _quantile(lengths, 0.99),
               "length_max": max(lengths), "checkpoint": rel is not None,
               "ngram8_seen_frac": statistics.mean(shares) if shares else None,
               "truncated_frac": statistics.mean(r.finish_reason == "length" for r in rollouts),
               "distinct_frac": statistics.mean(len({tuple(rollouts[g + i].token_ids) for i in range(cfg.n)})
                                                / cfg.n for g in range(0, len(rollouts), cfg.n)),
               "repeat_frac": statistics.mean(repeats) if repeats else None,
               "loss": loss, "rollout_s": t1 - t0, "step_s": time.perf_counter() - t0,
               "_lengths": lengths}
        stats.append(row)
        row = {k: v for k, v in row.items() if k != "_lengths"}
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", len=f"{row['length_mean']:.1f}")
        if progress:
            tqdm.write(format_row(row))
    if scratch.exists():
        shutil.rmtree(scratch)
    summary = {"config": asdict(cfg), "sft_s": t_sft, "sft_final_loss": statistics.mean(sft_losses[-10:]),
               "wall_s": time.perf_counter() - t_start, "steps": stats,
               "lengths": length_summary([n for row in stats for n in row.pop("_lengths")])}
    (out / "stats.json").write_text(json.dumps(summary, indent=1))
    engine.close()
    return out


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
