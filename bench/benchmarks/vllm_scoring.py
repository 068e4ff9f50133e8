"""Memory and seconds per iteration of vLLM's Python-verified path at a real vocabulary.

The path verifies drafts with the suite's coupled rule, which reads the whole distribution at
every draft node. Asking vLLM for it as logprobs (``prompt_logprobs=-1``) returns a Python dict of
the whole vocabulary at every prompt position of every row, and skips vLLM's prefix cache; the
node requests of ``bench.engines.vllm.node_reads`` compute the rule's reading on the worker
instead. This runs one rollout call of that path on a random-weight Qwen2 of Qwen2.5-0.5B's
vocabulary (151,936) with a drafter that proposes ``--draft`` tokens every iteration, and reports
the peak resident-set growth of the process during the call (Linux ``VmHWM``, reset before it),
seconds per iteration and what vLLM was asked. Run it on two checkouts to compare them.

    python -m bench.benchmarks vllm-scoring --rows 2 --prompt 32 --new 8 --draft 8   (in the vLLM environment)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

QWEN2_05B_VOCAB = 151_936


class ChainDrafter:
    """Proposes ``k`` tokens (the last emitted token, repeated) at every iteration: drafts of a
    fixed length whatever the model emits, so both paths verify the same amount every iteration."""

    drafts = "decoding"

    def __init__(self, k: int):
        self.k, self.last = k, {}

    def begin_step(self, step: int) -> None:
        pass

    def start(self, key, prompt) -> None:
        self.last[key] = prompt[-1]

    def propose(self, key, output, budget):
        from methods.base import Draft
        return Draft([self.last[key]] * min(self.k, budget))

    def observe(self, key, tokens) -> None:
        if tokens:
            self.last[key] = tokens[-1]

    def finish(self, key, rollout) -> None:
        pass


def _checkpoint(out: Path, a: argparse.Namespace) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(a.seed)
    eos = a.vocab - 1
    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=a.prompt + a.new + a.draft + 64, tie_word_embeddings=True,
                      bos_token_id=eos, eos_token_id=eos)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out))
    GenerationConfig(bos_token_id=eos, eos_token_id=eos).save_pretrained(str(out))
    return out


def measure(a: argparse.Namespace) -> dict:
    import torch
    from methods.base import RolloutKey

    from bench.benchmarks.verify_scale import _memory_now, _reset_peak
    from bench.core.engine_protocol import Request
    from bench.core.sampling import SamplingConfig
    from bench.core.verify import VerifyConfig
    from bench.engines import make_engine

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.TemporaryDirectory(prefix="vllm-scoring-") as tmp:
        eng = make_engine("vllm", gpu_memory_utilization=a.kv_share, spec_verify="python")
        eng.load(_checkpoint(Path(tmp) / "qwen2", a))
        g = torch.Generator().manual_seed(a.seed + 1)
        reqs = [Request(RolloutKey(f"p{b}", 0), torch.randint(0, a.vocab - 1, (a.prompt,), generator=g).tolist(), 1)
                for b in range(a.rows)]
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=a.new, stop_token_ids=[])
        sent = []
        run = eng._run

        def spy(llm, items, *args, **kwargs):
            sent.extend(params for _, _, params in items)
            return run(llm, items, *args, **kwargs)

        eng._run = spy
        eng.rollout(reqs, SamplingConfig(temperature=1.0, max_new_tokens=2), ChainDrafter(a.draft),
                    VerifyConfig())  # warm-up: the first call of a batch shape pays vLLM's lazy allocations
        sent.clear()
        rss0, _ = _memory_now()
        _reset_peak()
        t = time.perf_counter()
        out = eng.rollout(reqs, sampling, ChainDrafter(a.draft), VerifyConfig())
        seconds = time.perf_counter() - t
        _, hwm = _memory_now()
        eng.close()
    iterations = max(r.num_forward_passes for r in out)
    mb = 2 ** 20
    return {"rows": a.rows, "prompt": a.prompt, "new_tokens": a.new, "draft": a.draft, "vocab": a.vocab,
            "layers": a.layers, "hidden": a.hidden, "path": getattr(eng, "last_path", "python loop"),
            "iterations": iterations, "tokens": sum(len(r.token_ids) for r in out),
            "draft_tokens": sum(r.num_draft_tokens for r in out),
            "accepted_tokens": sum(r.num_accepted_tokens for r in out),
            "requests": len(sent), "full_vocab_requests": sum(p.prompt_logprobs == -1 or p.logprobs == -1 for p in sent),
            "peak_growth_mb": (hwm - rss0) / mb, "seconds": seconds, "seconds_per_iteration": seconds / iterations}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.benchmarks vllm-scoring", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--new", type=int, default=8, help="max new tokens per row")
    p.add_argument("--draft", type=int, default=8, help="draft tokens proposed every iteration")
    p.add_argument("--vocab", type=int, default=QWEN2_05B_VOCAB)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--kv-share", type=float, default=0.05, help="vLLM's gpu_memory_utilization (CPU: share of RAM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the row here")
    a = p.parse_args(argv)
    for name in ("rows", "prompt", "new", "draft", "vocab", "layers", "hidden", "heads", "kv_heads"):
        if getattr(a, name) < 1:
            raise SystemExit(f"vllm-scoring: --{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        raise SystemExit(f"vllm-scoring: --hidden ({a.hidden}) must be a multiple of --heads ({a.heads}) and "
                         f"--heads a multiple of --kv-heads ({a.kv_heads})")
    row = measure(a)
    from bench.benchmarks.helpers import print_row
    print_row(row, a.json)


if __name__ == "__main__":
    main(sys.argv[1:])
