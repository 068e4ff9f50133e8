"""Low-rank adapters (LoRA) on a Hugging Face causal LM, so a GRPO run on the real model trains a
few hundred thousand parameters and stores each checkpoint as a small delta on the packaged base.

    python -m pytest -q tests/test_lora.py

``add_lora`` freezes the model and wraps the chosen linear layers (by default every attention
layer's q and v projections) so that y = W x + (alpha / rank) B A x, with A small random and B zero:
the adapted model starts as the base. The recorder's GRPO update (``bench.traces.record
.policy_gradient.grpo_update``) trains it like any model, with an optimizer over
``lora_parameters`` only; ``save_lora`` writes the adapters as a delta checkpoint
(``bench.traces.deltas``), which every engine loads merged: W' = W + (alpha / rank) B A.
No dependency beyond torch (the peft package is not needed for this).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

TARGETS = ("q_proj", "v_proj")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None):
        super().__init__()
        self.base, self.rank, self.scale = base, rank, alpha / rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.randn(rank, w.shape[1], generator=generator, dtype=torch.float32)
                                   / w.shape[1] ** 0.5)
        self.lora_B = nn.Parameter(torch.zeros(w.shape[0], rank, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * ((x.to(self.lora_A.dtype) @ self.lora_A.T) @ self.lora_B.T).to(x.dtype)


def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, targets=TARGETS, seed: int = 0) -> dict[str, LoRALinear]:
    """Freeze ``model`` and wrap every linear layer whose name ends in one of ``targets``; returns
    {weight name in the base's state dict: its wrapper}. A second call is refused."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("this model already has LoRA adapters")
    found = [(name, module, child_name, child) for name, module in model.named_modules()
             for child_name, child in module.named_children()
             if isinstance(child, nn.Linear) and child_name.endswith(tuple(targets))]
    if not found:
        raise ValueError(f"no linear layer of the model ends in {tuple(targets)}: pass the target names")
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    wrapped: dict[str, LoRALinear] = {}
    for name, module, child_name, child in found:
        lora = LoRALinear(child, rank, alpha, g)
        setattr(module, child_name, lora)
        wrapped[f"{name}.{child_name}.weight" if name else f"{child_name}.weight"] = lora
    return wrapped


def lora_parameters(wrapped: dict[str, LoRALinear]) -> list[nn.Parameter]:
    return [p for m in wrapped.values() for p in (m.lora_A, m.lora_B)]


def save_lora(wrapped: dict[str, LoRALinear], out: Path, base: str) -> Path:
    """The adapters as a delta checkpoint on ``base`` (``bench.traces.deltas``)."""
    from bench.traces.deltas import write_delta
    scales = {m.scale for m in wrapped.values()}
    if len(scales) != 1:
        raise ValueError(f"the adapters have different scales {sorted(scales)}: save them one scale at a time")
    return write_delta(out, base, {name: (m.lora_A, m.lora_B) for name, m in wrapped.items()}, scale=scales.pop())
