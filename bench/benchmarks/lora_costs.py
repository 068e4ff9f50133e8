"""What a LoRA GRPO run on the real model costs here: a checkpoint's size as a delta, the merge an
engine waits for, and one gradient step, so the recording can be planned against its time budget.

    python -m bench.benchmarks lora-costs --rank 8 --rollouts 16 --tokens 250

On SmolLM2-135M-Instruct (``bench.traces.real_model``): adapters of ``--rank`` on the q and v
projections (``bench.traces.record.lora``), random values, saved as a delta checkpoint
(``bench.traces.deltas``) and merged into the cache (the first merge into an empty cache folder, then
a reuse in this process); then one ``grpo_update`` gradient step over ``--rollouts`` random
rollouts of ``--tokens`` tokens (a 60-token prompt included), ``micro_batch_tokens=2048``.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def measure(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from bench.traces import deltas
    from bench.traces.real_model import ensure_real_model
    from bench.traces.record.lora import add_lora, lora_parameters, save_lora
    from bench.traces.record.policy_gradient import grpo_update

    base = ensure_real_model()
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    wrapped = add_lora(model, rank=a.rank, alpha=2.0 * a.rank, seed=a.seed)
    g = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():
        for m in wrapped.values():
            m.lora_B.normal_(0.0, 0.01, generator=g)
    saved_cache = os.environ.get("SPECROLLOUT_CACHE")
    with tempfile.TemporaryDirectory(prefix="lora-costs-") as tmp:
        # the base named by its path, so an empty cache folder makes the merge a first one
        delta_dir = Path(tmp) / "delta"
        delta = save_lora(wrapped, delta_dir, os.path.relpath(base, delta_dir))
        os.environ["SPECROLLOUT_CACHE"] = str(Path(tmp) / "cache")
        try:
            size = (delta / deltas.TENSORS).stat().st_size
            t = time.perf_counter()
            merged = deltas.materialize(delta)
            merge_s = time.perf_counter() - t
            t = time.perf_counter()
            deltas.materialize(delta)
            reuse_s = time.perf_counter() - t
            merged_bytes = sum(f.stat().st_size for f in merged.iterdir())
        finally:
            if saved_cache is None:
                os.environ.pop("SPECROLLOUT_CACHE", None)
            else:
                os.environ["SPECROLLOUT_CACHE"] = saved_cache
    vocab = model.config.vocab_size
    response = a.tokens - 60
    rows = [(torch.randint(0, vocab, (60,), generator=g).tolist(), torch.randint(0, vocab, (response,), generator=g).tolist(),
             [-5.0] * response, 1.0 if i % 2 else -1.0) for i in range(a.rollouts)]
    opt = torch.optim.Adam(lora_parameters(wrapped), lr=1e-4)
    cfg = SimpleNamespace(grad_steps=1, temperature=1.0, clip=0.2, micro_batch_tokens=2048)
    t = time.perf_counter()
    grpo_update(model, opt, rows, cfg)
    step_s = time.perf_counter() - t
    return {"rank": a.rank, "targets": len(wrapped), "trainable": sum(p.numel() for p in lora_parameters(wrapped)),
            "delta_mib": size / 2 ** 20, "merged_mib": merged_bytes / 2 ** 20, "merge_s": merge_s,
            "reuse_s": reuse_s, "rollouts": a.rollouts, "tokens_each": a.tokens, "threads": torch.get_num_threads(),
            "grad_step_s": step_s, "ms_per_token": 1e3 * step_s / (a.rollouts * a.tokens)}


def main(argv=None) -> None:
    import torch

    from bench.benchmarks.helpers import parser, print_row
    p = parser("lora-costs", __doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=250, help="tokens per rollout, a 60-token prompt included")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the row here")
    a = p.parse_args(argv)
    for name in ("rank", "rollouts", "threads"):
        if getattr(a, name) < 1:
            raise SystemExit(f"lora-costs: --{name} must be >= 1, got {getattr(a, name)}")
    if a.tokens <= 60:
        raise SystemExit(f"lora-costs: --tokens must be more than the 60-token prompt, got {a.tokens}")
    torch.set_num_threads(a.threads)
    print_row(measure(a), a.json)


if __name__ == "__main__":
    main(sys.argv[1:])
