"""The GRPO update: group-normalised advantages and clipped policy-gradient steps on a batch of rollouts.

The recorder (``bench.traces.record.grpo``) trains its policy with these between recorded steps,
and the closed loop (``bench.train.loop``) trains with the very same code, so an exact method's
run updates the weights exactly as the baseline's. Kept apart from the recorder's loop because
both loops share it.

    python -m bench.traces.record --out DIR --tiny     # records a trace, training with grpo_update
    python -m pytest -q tests/test_record.py tests/test_train.py
"""
from __future__ import annotations

import statistics
from typing import Protocol

import torch


class UpdateConfig(Protocol):
    """What an update reads of its run's config (the recorder's ``RecordConfig``, the closed loop's)."""

    grad_steps: int
    temperature: float
    clip: float


def group_advantages(rewards: list[float], n: int, eps: float) -> list[float]:
    """GRPO's advantages: each reward less its group's mean, over the group's (population) standard
    deviation plus ``eps``; a group is ``n`` consecutive rewards (the samples of one prompt)."""
    advantages = []
    for g in range(0, len(rewards), n):
        group = rewards[g:g + n]
        mean, std = statistics.mean(group), statistics.pstdev(group)
        advantages += [(x - mean) / (std + eps) for x in group]
    return advantages


def grpo_update(model, opt, batch: list[tuple[list[int], list[int], list[float], float]],
                cfg: UpdateConfig) -> float:
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
