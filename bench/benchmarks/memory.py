"""Peak memory of torch_ref's long first-draft pass against the KV cache that pass reads.

torch_ref must verify 4,096-token first drafts (SPEC-RL's prefix reuse) at batch 128 on a
Qwen2-shape model with peak extra memory within 2x the KV cache it reads. This runs ONE such
pass through the engine's own code: a random-weight Qwen2 checkpoint saved to a temporary folder,
``TorchRefEngine.load``, the scheduler's first iteration (prompt + first draft in one block, in
tiles of rows x queries, ``TorchBackend._chunked``; verification by ``bench.core.verify.verify_nodes``),
and reports the peak resident-set growth of this process (Linux ``VmHWM``, reset before the pass)
beside the KV bytes the pass reads. The drafts are random tokens, so the verifier rejects them
early: the forward covers every position whatever the verdict, the verifier's workspace is
bounded by ``CHUNK_BYTES`` whatever it reads (a fully accepted draft only costs it more time).

What scales with what, so that a model cut to a few layers (``--layers``, to fit a small machine)
still answers for the full one: the KV grows with the layers; the hidden states kept for the
verifier (batch x draft x hidden) and one layer's tile work (one layer runs at a time) do not.
``extra_per_layer_kv`` is the extra memory in units of one layer's KV; ``extra_x_kv_at`` divides
it by the KV of ``--full-layers`` layers (24: Qwen2.5-0.5B), an extrapolation, labelled so.

    python -m bench.benchmarks.memory --batch 128 --draft 4096 --layers 1
    python -m bench.benchmarks.memory --batch 16 --draft 1024 --layers 2 --intermediate 896
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN2_05B = {"vocab": 151_936, "hidden": 896, "intermediate": 4864, "heads": 14, "kv_heads": 2, "layers": 24}
EOS = 151_643


def _checkpoint(out: Path, a: argparse.Namespace) -> Path:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(a.seed)
    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=a.prompt + a.draft + 8, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, bos_token_id=EOS % a.vocab, eos_token_id=EOS % a.vocab)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out))
    GenerationConfig(bos_token_id=EOS % a.vocab, eos_token_id=EOS % a.vocab).save_pretrained(str(out))
    return out


def measure(a: argparse.Namespace) -> dict:
    """One first-draft pass of ``a.batch`` rows (``a.prompt`` prompt tokens, ``a.draft`` drafted)."""
    from methods.base import RolloutKey
    from methods.oracle import OracleDrafter

    from bench.benchmarks.verify_scale import _memory_now, _reset_peak
    from bench.core.engine_protocol import Request
    from bench.engines.torch import block as torch_block
    from bench.engines.torch.block import TorchBackend
    from bench.engines.torch.engine import TorchRefEngine
    from bench.core.sampling import SamplingConfig
    from bench.spec.scheduler import Scheduler
    from bench.core.verify import VerifyConfig

    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        eng = TorchRefEngine(dtype=a.dtype, threads=a.threads)
        eng.load(_checkpoint(Path(tmp) / "qwen2", a))
    g = torch.Generator().manual_seed(a.seed + 1)
    reqs = [Request(RolloutKey(f"p{b}", 0), torch.randint(0, a.vocab, (a.prompt,), generator=g).tolist(), 1)
            for b in range(a.batch)]
    futures = {r.key: torch.randint(0, a.vocab, (a.draft,), generator=g).tolist() for r in reqs}
    backend = TorchBackend(eng)  # what TorchRefEngine.rollout_steps drives, kept here to read its cache
    scheduler = Scheduler(backend, eng.policy)
    steps = scheduler.run(reqs, SamplingConfig(max_new_tokens=a.draft + 1), OracleDrafter(futures), VerifyConfig())
    itemsize = torch.finfo(eng.dtype).bits // 8
    view = a.prompt + a.draft
    kv_layer = 2 * a.batch * a.kv_heads * view * (a.hidden // a.heads) * itemsize
    rss0, _ = _memory_now()
    _reset_peak()
    t = time.perf_counter()
    next(steps)  # the first iteration: one forward pass over prompts + first drafts, verified
    seconds = time.perf_counter() - t
    _, hwm = _memory_now()
    steps.close()
    log, cache = scheduler.iteration_log[0], backend.cache
    tile = backend._tile(a.batch, view) if hasattr(backend, "_tile") else (a.batch, None)  # older code: whole rows
    chunked = a.batch * view * view * itemsize > torch_block.MASK_BYTES  # else one pass, one mask (short blocks)
    growth = hwm - rss0
    extra = growth - kv_layer * a.layers  # the cache itself is resident after the pass: not extra
    hidden = a.batch * (a.draft + 1) * a.hidden * itemsize
    mb = 2 ** 20
    return {"batch": a.batch, "prompt": a.prompt, "draft": a.draft, "layers": a.layers, "vocab": a.vocab,
            "hidden": a.hidden, "intermediate": a.intermediate, "heads": a.heads, "kv_heads": a.kv_heads,
            "dtype": a.dtype, "chunked": chunked, "tile_rows": tile[0], "tile_queries": tile[1],
            "passes": len(scheduler.iteration_log), "accepted": log["accepted_tokens"],
            "peak_growth_mb": growth / mb, "kv_read_mb": kv_layer * a.layers / mb,
            "kv_allocated_mb": sum(t.untyped_storage().nbytes() for t in cache._keys + cache._values) / mb,
            "extra_mb": extra / mb, "extra_x_kv": extra / (kv_layer * a.layers),
            "hidden_kept_mb": hidden / mb, "extra_per_layer_kv": extra / kv_layer,
            f"extra_x_kv_at_{a.full_layers}_layers (extrapolated)": extra / (kv_layer * a.full_layers),
            "seconds": seconds, "forward_s": log["forward_s"], "verify_s": log["verify_s"]}


def _check(a: argparse.Namespace) -> None:
    from bench.engines.torch.engine import DTYPES
    for name in ("batch", "prompt", "draft", "layers", "vocab", "hidden", "intermediate", "heads", "kv_heads",
                 "full_layers"):
        if getattr(a, name) < 1:
            raise SystemExit(f"memory_bench: --{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        raise SystemExit(f"memory_bench: --hidden ({a.hidden}) must be a multiple of --heads ({a.heads}) and "
                         f"--heads a multiple of --kv-heads ({a.kv_heads})")
    if a.dtype not in DTYPES:
        raise SystemExit(f"memory_bench: --dtype must be one of {sorted(DTYPES)}, got {a.dtype!r}")
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("memory_bench: needs Linux (/proc/self/status VmHWM and /proc/self/clear_refs)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.benchmarks.memory", description=__doc__.split("\n\n")[0])
    d = QWEN2_05B
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--draft", type=int, default=4096, help="first-draft tokens per row")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per row")
    p.add_argument("--layers", type=int, default=1, help=f"decoder layers (Qwen2.5-0.5B: {d['layers']})")
    p.add_argument("--full-layers", type=int, default=d["layers"], help="the depth extrapolated to")
    for name in ("vocab", "hidden", "intermediate", "heads", "kv_heads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=d[name],
                       help=f"default {d[name]} (Qwen2.5-0.5B)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the row here")
    a = p.parse_args(argv)
    _check(a)
    row = measure(a)
    from bench.benchmarks.helpers import print_row
    print_row(row, a.json)


if __name__ == "__main__":
    main(sys.argv[1:])
