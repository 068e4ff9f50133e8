"""A short supervised warm start that leaves the tiny policy partly trained and stochastic.

    python -m bench.traces.record.sft --steps 250 --out sft_policy

The policy learns the answer format and some arithmetic from enumerated valid answers, but is
stopped early on purpose: a converged model is nearly deterministic, and a trace recorded from it
would make every drafter look perfect (acceptance numbers would be meaningless).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.traces.record import task as countdown


@dataclass
class SFTConfig:
    steps: int = 250
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup: int = 10
    num_problems: int = 2000
    seed: int = 0
    decay: bool = False  # linear decay of the rate to 10% at the last step (after the warmup)


def encode_example(tokenizer, problem: countdown.Problem, answer: str) -> tuple[list[int], int]:
    """Token ids of <bos> prompt answer <eos>, and the index where the answer starts."""
    prompt_ids = tokenizer(problem.prompt)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids + [tokenizer.eos_token_id], len(prompt_ids)


def collate(examples: list[tuple[list[int], int]], pad_id: int):
    """-> input_ids [B, T], attention_mask [B, T], labels [B, T] (-100 outside answers)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, start) in enumerate(examples):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, start:len(ids)] = torch.tensor(ids[start:])
        mask[row, :len(ids)] = 1
    return input_ids, mask, labels


def sft(model, tokenizer, cfg: SFTConfig, progress: bool = True, make_batch=None) -> list[float]:
    """Train ``model`` in place on random valid answers of seeded problems; returns the losses.

    ``make_batch(rng) -> [(token ids, answer start), ...]`` replaces the short task's examples
    (the search task's transcripts); by default a batch is random valid answers of the short task.
    """
    if make_batch is None:
        problems = countdown.make_problems(cfg.num_problems, seed=cfg.seed + 1_000_003)
        answers = [countdown.solutions(p) for p in problems]
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: (min(1.0, (i + 1) / cfg.warmup) if cfg.warmup else 1.0)
        * (1.0 - 0.9 * i / max(1, cfg.steps - 1) if cfg.decay else 1.0))
    model.train()
    losses = []
    bar = tqdm(range(cfg.steps), desc="sft", disable=not progress)
    for _ in bar:
        if make_batch is not None:
            batch = make_batch(rng)
        else:
            picks = [rng.randrange(len(problems)) for _ in range(cfg.batch_size)]
            batch = [encode_example(tokenizer, problems[i], rng.choice(answers[i])) for i in picks]
        input_ids, mask, labels = collate(batch, tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


@torch.no_grad()
def sample_reward(model, tokenizer, problems: list[countdown.Problem], n: int = 4,
                  max_new_tokens: int = 24, seed: int = 0) -> dict:
    """A quick temperature-1 check with HF ``generate`` (diagnostics only; the recorder samples
    with the reference engine): reward mean, distinct answers per prompt, mean length."""
    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    enc = tokenizer([p.prompt for p in problems for _ in range(n)], return_tensors="pt",
                    padding=True)
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    rewards = [countdown.reward(problems[i // n], t) for i, t in enumerate(texts)]
    distinct = [len(set(texts[i:i + n])) for i in range(0, len(texts), n)]
    return {"reward_mean": statistics.mean(rewards),
            "correct": statistics.mean(r == countdown.REWARD_CORRECT for r in rewards),
            "distinct_per_prompt": statistics.mean(distinct),
            "length_mean": statistics.mean(len(t) + 1 for t in texts), "examples": texts[:6]}


def main() -> None:
    from bench.traces.record.model import build_model, save_checkpoint
    from bench.traces.record.tokenizer import build_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=SFTConfig.steps)
    ap.add_argument("--lr", type=float, default=SFTConfig.lr)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tok = build_tokenizer()
    model = build_model(tok, seed=args.seed)
    t0 = time.perf_counter()
    losses = sft(model, tok, SFTConfig(steps=args.steps, lr=args.lr, seed=args.seed))
    print(f"sft: {args.steps} steps in {time.perf_counter() - t0:.1f}s, final loss "
          f"{statistics.mean(losses[-10:]):.3f}")
    print(sample_reward(model, tok, countdown.make_problems(64, seed=args.seed + 7)))
    if args.out:
        save_checkpoint(model, tok, args.out)


if __name__ == "__main__":
    main()
