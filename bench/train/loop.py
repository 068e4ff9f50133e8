"""The closed loop: GRPO on the bundled task with the rollouts of one method and verify rule.

The recorder's loop (``bench.traces.record.grpo``) with two changes that make it a comparison of methods:
rollouts come from the chosen method's drafter and rule (its caches live across steps, as they
would in a trainer), and the old log-probs of the policy-gradient ratio are recomputed by the
trainer's own forward pass, as verl does, rather than taken from the engine. So the update depends
on the sampled tokens only, and an exact method, whose tokens equal the baseline's, trains the
very same weights (tested bit for bit in float64). A lossy rule (SPEC-RL's ratio rule) changes
tokens and therefore what is learnt: the question this loop answers.

Per step: sync the policy into the engine, score the held-out set, roll out, reward, update.
Seconds are measured per phase: ``sync_s`` (save and load the weights), ``rollout_s``,
``train_s`` (old log-probs and the update); ``eval_s`` (the held-out pass) is bookkeeping and
counts in no step time.
"""
from __future__ import annotations

import gc
import hashlib
import io
import pickle
import shutil
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from methods.base import NullDrafter, RolloutKey

from bench.core.engine_protocol import Request
from bench.core.errors import UserError
from bench.traces.record.grpo import RecordConfig, response_ids, step_prompts
from bench.traces.record.policy_gradient import group_advantages, grpo_update
from bench.harness.replay import MethodSpec, RunAheadQueue
from bench.report.results import rollout_row, step_row
from bench.core.verify import VerifyConfig
from bench.train.store import TrainRunFolder
from bench.train.warmstart import ensure_warm_start, heldout_logprobs, load_heldout, padded_batch, problems_for, sampling_for

TASKS = {"countdown": RecordConfig, "countdown-tiny": RecordConfig.tiny}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class TrainConfig:
    """What a closed-loop run trains on; the method and rule come separately (``MethodSpec``)."""

    task: str = "countdown"  # a bench.traces.record preset: countdown (32 steps) or countdown-tiny (tests)
    steps: int | None = None  # None: the task's GRPO steps
    seed: int = 0  # the RL seed: coupled-sampling keys and the prompt order
    init_seed: int = 0  # the warm start's seed, shared by every run of a sweep
    dtype: str = "float32"  # the policy's weights in trainer and engine (the update's loss is fp32 as in the recorder)
    heldout_prompts: int = 16
    heldout_samples: int = 2

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise UserError(f"task={self.task!r} is not a closed-loop task; choose one of {', '.join(TASKS)}")
        if self.dtype not in DTYPES:
            raise UserError(f"dtype={self.dtype!r}: the closed loop trains in {' or '.join(DTYPES)}")
        for name in ("steps", "heldout_prompts", "heldout_samples"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise UserError(f"{name}={value!r} must be a whole number >= 1")
        for name in ("seed", "init_seed"):
            if not isinstance(getattr(self, name), int):
                raise UserError(f"{name}={getattr(self, name)!r} must be a whole number")

    def record_config(self) -> RecordConfig:
        return TASKS[self.task](seed=self.init_seed)

    @property
    def num_steps(self) -> int:
        return self.steps or self.record_config().steps

    def warm_start_key(self) -> str:
        """Names the warm start and held-out set every run of this config starts from."""
        from bench.train.warmstart import warm_start_key
        return warm_start_key(self.record_config(), self.heldout_prompts, self.heldout_samples)


def weights_sha1(model) -> str:
    """A digest of every parameter's bytes, in state-dict order: equal digests, equal weights."""
    h = hashlib.sha1()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def recompute_logprobs(model, rows: list[tuple[list[int], list[int]]], temperature: float) -> list[list[float]]:
    """The trainer's log-probs of each (prompt, response)'s response tokens (the 'old' policy of
    the clipped ratio, recomputed as verl does: independent of how the engine computed its own)."""
    out: list[list[float]] = [[] for _ in rows]
    live = [i for i, (_, r) in enumerate(rows) if r]
    if not live:
        return out
    ids, attn = padded_batch([rows[i] for i in live])
    logits = model(input_ids=ids, attention_mask=attn).logits
    logp = torch.log_softmax(logits / max(temperature, 1e-6), -1)
    for j, i in enumerate(live):
        p, r = rows[i]
        span = logp[j, len(p) - 1:len(p) + len(r) - 1]
        out[i] = span.gather(-1, torch.tensor(r)[:, None])[:, 0].tolist()
    return out


class StopAfter(RuntimeError):
    """Raised by ``run_training(stop_after_steps=k)`` after k committed steps (tests' crash)."""


def run_training(run_dir: Path, method: MethodSpec, cfg: TrainConfig, identity: dict,
                 labels: dict | None = None, progress: bool = True,
                 stop_after_steps: int | None = None) -> Path:
    """Train ``cfg.num_steps`` GRPO steps with ``method``'s rollouts into ``run_dir``, resuming
    after its last committed step. Returns ``run_dir``."""
    folder = TrainRunFolder(run_dir, identity)
    done = folder.done_steps()
    if len(done) >= cfg.num_steps:
        return folder.run_dir
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic reductions, and the fastest for a tiny model here
    try:
        _train(folder, method, cfg, dict(labels or {}), len(done), progress, stop_after_steps)
    finally:
        torch.set_num_threads(previous)
    return folder.run_dir


@dataclass
class _TrainingRun:
    """What every step of one closed-loop run works with: the folder it commits to, the method and
    its drafter, the policy with its optimizer, the prompts and the engine."""

    folder: TrainRunFolder
    method: MethodSpec
    cfg: TrainConfig
    rec: RecordConfig
    labels: dict
    tok: Any
    model: Any
    opt: Any
    drafter: Any
    heldout: Any
    pids: list[str]
    by_pid: dict[str, Any]
    prompt_tokens: dict[str, list[int]]
    schedule: RecordConfig  # the recorder's config with the RL seed: the prompt order
    sampling: Any
    engine: Any
    scratch: Path  # where the policy is saved for the engine to load


def _start(folder: TrainRunFolder, method: MethodSpec, cfg: TrainConfig, labels: dict, start: int,
           progress: bool) -> _TrainingRun:
    """The warm start (or the state committed after step ``start - 1``), the prompts and the engine."""
    from transformers import AutoModelForCausalLM

    from bench.engines.torch.engine import TorchRefEngine

    rec = cfg.record_config()
    warm = ensure_warm_start(rec, cfg.heldout_prompts, cfg.heldout_samples, progress)
    heldout = load_heldout(warm)
    tok = rec.build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(warm), dtype=DTYPES[cfg.dtype]).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=rec.lr, weight_decay=0.0)
    if start:
        state = torch.load(io.BytesIO(folder.load_state(start - 1)), weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        drafter = pickle.loads(state["drafter"])
    else:
        drafter = method.make_drafter()
    problems, _ = problems_for(rec, cfg.heldout_prompts)
    pids = [f"p{i:04d}" for i in range(len(problems))]
    by_pid = dict(zip(pids, problems))
    prompt_tokens = {pid: tok(p.prompt)["input_ids"] for pid, p in by_pid.items()}
    schedule = replace(rec, seed=cfg.seed)  # the prompt order follows the RL seed
    sampling = sampling_for(rec, seed=cfg.seed)
    engine = TorchRefEngine(device="cpu", dtype=cfg.dtype)
    return _TrainingRun(folder, method, cfg, rec, labels, tok, model, opt, drafter, heldout, pids, by_pid, prompt_tokens,
                schedule, sampling, engine, folder.run_dir / ".policy")


def _train(folder: TrainRunFolder, method: MethodSpec, cfg: TrainConfig, labels: dict, start: int,
           progress: bool, stop_after_steps: int | None) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    run = _start(folder, method, cfg, labels, start, progress)
    committed = 0
    warmed = False
    bar = tqdm(range(start, cfg.num_steps), desc=labels.get("setting", method.name), disable=not progress,
               unit="step", initial=start, total=cfg.num_steps)
    try:
        for step in bar:
            row = _train_step(run, step, warm_up=not warmed)
            warmed = True
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", rollout=f"{row['rollout_s']:.2f}s")
            committed += 1
            if stop_after_steps is not None and committed >= stop_after_steps and step + 1 < cfg.num_steps:
                raise StopAfter(f"stopped after {committed} step(s) (stop_after_steps)")
    finally:
        run.engine.close()
        shutil.rmtree(run.scratch, ignore_errors=True)


def _step_requests(run: _TrainingRun, step: int) -> tuple[list[Request], RunAheadQueue | None]:
    """The step's rollouts (n per prompt) and, for a run-ahead method, the next step's."""
    n = run.rec.n
    requests = [Request(RolloutKey(pid, i), run.prompt_tokens[pid], step)
                for pid in step_prompts(run.pids, run.schedule, step) for i in range(n)]
    run_ahead = None
    if run.method.run_ahead and step + 1 < run.cfg.num_steps:
        run_ahead = RunAheadQueue([Request(RolloutKey(pid, n + i), run.prompt_tokens[pid], step,
                                           run_ahead=True, anticipates=step + 1)
                                   for pid in step_prompts(run.pids, run.schedule, step + 1) for i in range(n)])
    return requests, run_ahead


def _train_step(run: _TrainingRun, step: int, warm_up: bool) -> dict:
    """One GRPO step: sync the policy into the engine, score the held-out set, roll out with the
    method, reward, update; commits the step and returns its row."""
    from bench.traces.record import task as countdown
    from bench.traces.record.model import save_checkpoint

    rec, drafter, method = run.rec, run.drafter, run.method
    t0 = time.perf_counter()
    save_checkpoint(run.model, run.tok, run.scratch)
    run.engine.load(run.scratch)
    sync_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    heldout_logp = heldout_logprobs(run.model, run.heldout, rec.temperature)
    eval_s = time.perf_counter() - t0

    requests, run_ahead = _step_requests(run, step)
    if warm_up:  # one throwaway call: one-time costs (allocator, kernels) hit no step's clock
        run.engine.rollout(requests[:1], run.sampling, NullDrafter(), VerifyConfig())
    drafter.begin_step(step)
    if hasattr(drafter, "reset_stats"):
        drafter.reset_stats()
    gc.collect()
    t0 = time.perf_counter()
    rollouts = run.engine.rollout(requests, run.sampling, drafter, method.verify, run_ahead=run_ahead)
    rollout_s = time.perf_counter() - t0
    trained = [r for r in rollouts if not r.run_ahead]
    rewards = [countdown.reward(run.by_pid[r.key.prompt_id],
                                run.tok.decode(response_ids(r.token_ids, run.tok.eos_token_id))) for r in trained]
    advantages = group_advantages(rewards, rec.n, rec.eps)

    t0 = time.perf_counter()
    pairs = [(list(r.prompt_token_ids), list(r.token_ids)) for r in trained]
    old = recompute_logprobs(run.model, pairs, rec.temperature)
    loss = grpo_update(run.model, run.opt, [(p, t, lp, a) for (p, t), lp, a in zip(pairs, old, advantages)], rec)
    train_s = time.perf_counter() - t0

    rows = [rollout_row(r, reward=x) for r, x in zip(trained, rewards)]
    stats = drafter.stats() if hasattr(drafter, "stats") else {}
    lengths = [len(r.token_ids) for r in trained]
    row = step_row(rows, rollout_s, run.engine.last_iterations, drafter_stats=stats, **run.labels,
                   step=step, method=method.name, rule=method.verify.rule,
                   lenience=method.verify.lenience if method.verify.rule == "ratio" else None,
                   correct_frac=statistics.mean(x == countdown.REWARD_CORRECT for x in rewards),
                   length_mean=statistics.mean(lengths), length_max=max(lengths), loss=loss,
                   rollout_s=rollout_s, train_s=train_s, sync_s=sync_s, eval_s=eval_s,
                   step_s=sync_s + rollout_s + train_s, weights_sha1=weights_sha1(run.model),
                   run_ahead_rollouts=len(rollouts) - len(trained),
                   rollout_passes=sum(r.num_forward_passes for r in trained))

    def save_state(f) -> None:
        torch.save({"model": run.model.state_dict(), "optimizer": run.opt.state_dict(),
                    "drafter": pickle.dumps(drafter, protocol=5), "step": step}, f)

    run.folder.commit(step, row, heldout_logp, save_state)
    return row
