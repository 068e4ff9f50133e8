"""Side-by-side speed benchmarks of the reference engine, measured in one process run.

    python -m bench.benchmarks engine-vs-hf   # torch_ref vs transformers generate, batch 1 and 32
    python -m bench.benchmarks oracle         # oracle-drafter speedup, budgets 4/8/16, 256 tokens

Each figure is the median of interleaved repeats; ratios are what matter (the machine is shared).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from methods.base import RolloutKey
from methods.baseline import Baseline
from methods.oracle import OracleDrafter

from .engines.base import Request
from .engines.torch_ref import TorchRefEngine
from .sampling import SamplingConfig
from .verify import VerifyConfig


def tiny_policy(out: Path, vocab: int = 64, hidden: int = 128, layers: int = 4, heads: int = 2) -> Path:
    """A random-init Llama of REFERENCE.md's size (about 1M parameters) with no EOS token, so
    every rollout runs to max_new_tokens and both engines do the same work."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=1024, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(str(out))
    GenerationConfig(bos_token_id=0, pad_token_id=0).save_pretrained(str(out))
    return out


def _requests(batch: int, prompt_len: int = 16) -> list[Request]:
    return [Request(RolloutKey(f"p{i}", 0), [1 + (i * 7 + j) % 60 for j in range(prompt_len)]) for i in range(batch)]


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def engine_vs_hf(ckpt: Path, batches=(1, 32), new_tokens: int = 128, repeats: int = 5) -> list[dict]:
    from transformers import AutoModelForCausalLM
    eng = TorchRefEngine()
    eng.load(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    rows = []
    for batch in batches:
        reqs = _requests(batch)
        ids = torch.tensor([r.prompt_token_ids for r in reqs])

        def ours():
            out = eng.rollout(reqs, sampling, Baseline(), VerifyConfig())
            assert all(len(r.token_ids) == new_tokens for r in out)

        def theirs():
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_p=1.0, top_k=0,
                                  temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=0)
            assert out.shape[1] == ids.shape[1] + new_tokens

        ours(), theirs()  # warm up
        t_ours, t_hf = [], []
        for _ in range(repeats):  # interleaved so drift hits both alike
            t_ours += _time(ours, 1)
            t_hf += _time(theirs, 1)
        tok = batch * new_tokens
        ours_s, hf_s = statistics.median(t_ours), statistics.median(t_hf)
        rows.append({"batch": batch, "new_tokens": new_tokens, "torch_ref_tok_s": tok / ours_s,
                     "hf_generate_tok_s": tok / hf_s, "ratio": hf_s / ours_s,
                     "ratio_min": min(t_hf) / max(t_ours), "ratio_max": max(t_hf) / min(t_ours)})
    return rows


def oracle_speedup(ckpt: Path, batches=(1, 32), budgets=(4, 8, 16), new_tokens: int = 256,
                   repeats: int = 3) -> list[dict]:
    eng = TorchRefEngine()
    eng.load(ckpt)
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    rows = []
    for batch in batches:
        reqs = _requests(batch)
        base = eng.rollout(reqs, sampling, Baseline(), VerifyConfig())
        futures = {r.key: r.token_ids for r in base}
        runs = {"baseline": lambda: eng.rollout(reqs, sampling, Baseline(), VerifyConfig())}
        for k in budgets:
            runs[k] = (lambda k=k: eng.rollout(reqs, sampling, OracleDrafter(futures, k), VerifyConfig()))
        times = {name: [] for name in runs}
        for _ in range(repeats):
            for name, fn in runs.items():
                times[name] += _time(fn, 1)
        for k in budgets:
            out = runs[k]()
            assert [r.token_ids for r in out] == [r.token_ids for r in base], "oracle rollouts must be identical"
            rows.append({"batch": batch, "budget": k, "tokens_per_step": sum(len(r.token_ids) for r in out) /
                         sum(r.num_forward_passes for r in out),
                         "speedup": statistics.median(times["baseline"]) / statistics.median(times[k]),
                         "baseline_s": statistics.median(times["baseline"]), "oracle_s": statistics.median(times[k])})
    return rows


def _print(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["engine-vs-hf", "oracle"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_policy(Path(tmp) / "policy")
        if args.which == "engine-vs-hf":
            _print(engine_vs_hf(ckpt, repeats=args.repeats))
        else:
            _print(oracle_speedup(ckpt, repeats=args.repeats))


if __name__ == "__main__":
    main()
