"""The GRPO recorder: SFT warm start, then GRPO steps whose checkpoints and rollouts form a trace.

    python -m bench.traces.record --out traces/countdown-tiny --tiny

Rollouts are sampled by the torch reference engine with the baseline drafter and coupled sampling
under the recorder's seed, so a baseline replay of the trace reproduces them token for token.
Each step: save the live policy as the step's checkpoint, sample n rollouts per prompt, score them,
then train on them (GRPO advantages, clipped policy gradient, engine logprobs as old logprobs:
``bench.traces.record.policy_gradient``); each step's stats row is ``bench.traces.record.step_stats``'s.
"""
from __future__ import annotations

import json
import random
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch
from tqdm import tqdm

from bench.traces.format import TraceSampling, checkpoint_relpath
from bench.traces.record import search_task
from bench.traces.record import task as countdown
from bench.traces.record.model import ModelConfig, build_model, save_checkpoint
from bench.traces.record.policy_gradient import group_advantages, grpo_update
from bench.traces.record.sft import SFTConfig, sft
from bench.traces.record.step_stats import RolloutHistory, format_row, length_summary, step_row
from bench.traces.record.tokenizer import build_tokenizer
from bench.traces.writer import TraceWriter

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

    def make_problems(self) -> list:
        return countdown.make_problems(self.num_prompts, seed=self.seed + 17)

    def prompt_text(self, tokenizer, problem) -> str:
        return problem.prompt

    def prompt_ids(self, tokenizer, problem) -> list[int]:
        return tokenizer(problem.prompt)["input_ids"]

    def build_policy(self, tokenizer, progress: bool) -> "Policy":
        """The policy GRPO starts from: the task's tiny Llama after its SFT warm start."""
        model = build_model(tokenizer, self.model_config(), seed=self.seed)
        losses = sft(model, tokenizer, self.sft_config(), progress=progress, make_batch=self.sft_batches(tokenizer))

        def save(folder: Path, scratch: Path) -> Path:
            return save_checkpoint(model, tokenizer, folder)
        return Policy(model, list(model.parameters()), save, losses)


@dataclass
class Policy:
    """The model GRPO trains, the parameters its optimizer updates, and how a step saves it:
    ``save(folder, scratch)`` writes the step's checkpoint into ``folder`` and returns the
    checkpoint directory the engine samples from (``folder`` itself, or a merged copy under
    ``scratch`` when ``folder`` holds a delta)."""

    model: Any
    parameters: list
    save: Callable[[Path, Path], Path]
    warm_start_losses: list[float]


def sparse_checkpoint(step: int, steps: int, every: int, last: int) -> bool:
    """Whether ``step`` keeps its policy: every ``every``-th step counted back from the last one,
    at most ``last`` of them (0: all)."""
    back = steps - 1 - step
    if back % max(1, every):
        return False
    return not last or back // max(1, every) < last


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
        return sparse_checkpoint(step, self.steps, self.checkpoint_every, self.checkpoint_last)

    def make_problems(self) -> list:
        return search_task.make_problems(self.num_prompts, seed=self.seed + 17, four_share=self.four_share,
                                         min_paths=self.min_paths, max_number=self.max_number, ops=self.ops)

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


@dataclass
class _Recording:
    """What every step of one recording works with: the trace being written, its prompts, and the
    policy with its optimizer and the engine that samples from it."""

    out: Path
    cfg: RecordConfig
    tok: Any
    writer: TraceWriter
    pids: list[str]
    prompt_tokens: dict[str, list[int]]
    by_pid: dict[str, Any]
    policy: Policy
    opt: Any
    engine: Any
    sampling: Any  # the SamplingConfig the engine samples with
    scratch: Path  # the live policy of a step that keeps no checkpoint


def _write_prompts(writer: TraceWriter, cfg: RecordConfig, tok) -> tuple[list[str], dict[str, list[int]], dict]:
    """The task's problems as the trace's prompts: (prompt ids, their tokens, problem by id)."""
    problems = cfg.make_problems()
    pids = [f"p{i:04d}" for i in range(len(problems))]
    prompt_tokens = {pid: cfg.prompt_ids(tok, p) for pid, p in zip(pids, problems)}
    by_pid = dict(zip(pids, problems))
    writer.write_prompts([{"prompt_id": pid, "token_ids": prompt_tokens[pid], "text": cfg.prompt_text(tok, p),
                           **p.metadata()} for pid, p in by_pid.items()])
    return pids, prompt_tokens, by_pid


def _record(out: Path, cfg: RecordConfig, progress: bool) -> Path:
    from bench.engines.torch.engine import TorchRefEngine
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t_start = time.perf_counter()
    tok = cfg.build_tokenizer()
    sampling = TraceSampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens, cfg.n, cfg.seed)
    writer = TraceWriter(out, cfg.name, sampling, vocab_size=len(tok), task=cfg.task_module.NAME,
                         extra={"recorder": {"version": RECORDER_VERSION, **asdict(cfg)}})
    tok.save_pretrained(str(out / writer.tokenizer))
    pids, prompt_tokens, by_pid = _write_prompts(writer, cfg, tok)

    policy = cfg.build_policy(tok, progress)
    t_sft = time.perf_counter() - t_start
    opt = torch.optim.AdamW(policy.parameters, lr=cfg.lr, weight_decay=0.0)
    engine = TorchRefEngine(device="cpu", dtype="float32")
    rec = _Recording(out, cfg, tok, writer, pids, prompt_tokens, by_pid, policy, opt, engine,
                     sampling.to_config(), out / ".policy")
    history = RolloutHistory()
    stats: list[dict] = []
    bar = tqdm(range(cfg.steps), desc="grpo", disable=not progress)
    for step in bar:
        row = _record_step(rec, step, history)
        stats.append(row)
        row = {k: v for k, v in row.items() if k != "_lengths"}
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", len=f"{row['length_mean']:.1f}")
        if progress:
            tqdm.write(format_row(row))
    if rec.scratch.exists():
        shutil.rmtree(rec.scratch)
    losses = policy.warm_start_losses
    summary = {"config": asdict(cfg), "sft_s": t_sft, "sft_final_loss": statistics.mean(losses[-10:]) if losses else None,
               "wall_s": time.perf_counter() - t_start, "steps": stats,
               "lengths": length_summary([n for row in stats for n in row.pop("_lengths")])}
    (out / "stats.json").write_text(json.dumps(summary, indent=1))
    engine.close()
    return out


def _record_step(rec: _Recording, step: int, history: RolloutHistory) -> dict:
    """One GRPO step: save the policy (the step's checkpoint, or scratch), sample and score its
    rollouts, write them to the trace, then train on them; returns the step's stats row."""
    from bench.core.engine_protocol import Request
    from bench.core.verify import VerifyConfig
    from methods.base import RolloutKey
    from methods.baseline import Baseline

    cfg, tok = rec.cfg, rec.tok
    t0 = time.perf_counter()
    rel = checkpoint_relpath(step) if cfg.has_checkpoint(step) else None
    rec.engine.load(rec.policy.save(rec.out / rel if rel else rec.scratch / "step", rec.scratch))
    batch_pids = step_prompts(rec.pids, cfg, step)
    requests = [Request(RolloutKey(pid, i), rec.prompt_tokens[pid], step=step)
                for pid in batch_pids for i in range(cfg.n)]
    rollouts = rec.engine.rollout(requests, rec.sampling, Baseline(), VerifyConfig())
    t1 = time.perf_counter()
    rewards = [cfg.task_module.reward(rec.by_pid[r.key.prompt_id],
                                      tok.decode(response_ids(r.token_ids, tok.eos_token_id)))
               for r in rollouts]
    df = pd.DataFrame({"prompt_id": [r.key.prompt_id for r in rollouts],
                       "sample_idx": [r.key.sample_idx for r in rollouts],
                       "token_ids": [list(r.token_ids) for r in rollouts],
                       "logprobs": [list(r.logprobs) for r in rollouts],
                       "reward": rewards,
                       "finish_reason": [r.finish_reason for r in rollouts]})
    rec.writer.add_step(step, rel, batch_pids, rec.writer.write_rollouts(step, df))

    repeats, shares = history.observe(rollouts, batch_pids)
    advantages = group_advantages(rewards, cfg.n, cfg.eps)
    if getattr(cfg, "overlong_filter", False):  # DAPO's overlong filtering: a truncated answer trains nothing
        advantages = [0.0 if r.finish_reason == "length" else a for r, a in zip(rollouts, advantages)]
    loss = 0.0
    if step < cfg.steps - 1:  # the last step's rollouts train nothing that is recorded
        loss = grpo_update(rec.policy.model, rec.opt, [(r.prompt_token_ids, list(r.token_ids), list(r.logprobs), a)
                                                for r, a in zip(rollouts, advantages)], cfg)
    return step_row(step, rollouts, rewards, cfg.n, repeats, shares, checkpoint=rel is not None, loss=loss,
                    rollout_s=t1 - t0, step_s=time.perf_counter() - t0)
