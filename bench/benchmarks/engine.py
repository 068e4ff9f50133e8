"""The reference engine against transformers' ``generate`` (same policy, same tokens) and the
oracle drafter's speedup on it: the ceiling speculation could reach on this engine.

    python -m bench.benchmarks engine-vs-hf   # batch 1 and 32, 128 tokens
    python -m bench.benchmarks oracle         # budgets 4/8/16, 256 tokens

Each ratio is the median of back-to-back pairs (who goes first alternates), min and max beside it."""
from __future__ import annotations
import statistics
import tempfile
from pathlib import Path
import torch
from methods.baseline import Baseline
from methods.oracle import OracleDrafter
from bench.engines.torch.engine import TorchRefEngine
from bench.core.sampling import SamplingConfig
from bench.core.verify import VerifyConfig
from bench.benchmarks.helpers import parser
from bench.benchmarks.helpers import print_rows
from bench.benchmarks.helpers import synthetic_requests
from bench.benchmarks.helpers import time_call
from bench.benchmarks.helpers import tiny_policy
from bench.benchmarks.helpers import torch_setup


def engine_vs_hf(ckpt: Path, batches=(1, 32), new_tokens: int = 128, repeats: int = 5) -> list[dict]:
    from transformers import AutoModelForCausalLM
    eng = TorchRefEngine()
    eng.load(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    rows = []
    for batch in batches:
        reqs = synthetic_requests(batch)
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
        for r in range(repeats):  # interleaved so drift hits both alike; who goes first alternates
            if r % 2:
                t_hf += time_call(theirs, 1)
                t_ours += time_call(ours, 1)
            else:
                t_ours += time_call(ours, 1)
                t_hf += time_call(theirs, 1)
        tok = batch * new_tokens
        ours_s, hf_s = statistics.median(t_ours), statistics.median(t_hf)
        pairs = sorted(h / o for h, o in zip(t_hf, t_ours))  # each pair ran back to back
        rows.append({"batch": batch, "new_tokens": new_tokens, "torch_ref_tok_s": tok / ours_s,
                     "hf_generate_tok_s": tok / hf_s, "ratio": statistics.median(pairs),
                     "ratio_min": pairs[0], "ratio_max": pairs[-1]})
    return rows


def oracle_speedup(ckpt: Path, batches=(1, 32), budgets=(4, 8, 16), new_tokens: int = 256,
                   repeats: int = 3) -> list[dict]:
    eng = TorchRefEngine()
    eng.load(ckpt)
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    rows = []
    for batch in batches:
        reqs = synthetic_requests(batch)
        base = eng.rollout(reqs, sampling, Baseline(), VerifyConfig())
        futures = {r.key: r.token_ids for r in base}
        runs = {"baseline": lambda: eng.rollout(reqs, sampling, Baseline(), VerifyConfig())}
        for k in budgets:
            runs[k] = (lambda k=k: eng.rollout(reqs, sampling, OracleDrafter(futures, k), VerifyConfig()))
        times = {name: [] for name in runs}
        for _ in range(repeats):
            for name, fn in runs.items():
                times[name] += time_call(fn, 1)
        for k in budgets:
            out = runs[k]()
            assert [r.token_ids for r in out] == [r.token_ids for r in base], "oracle rollouts must be identical"
            rows.append({"batch": batch, "budget": k, "tokens_per_step": sum(len(r.token_ids) for r in out) /
                         sum(r.num_forward_passes for r in out),
                         "speedup": statistics.median(times["baseline"]) / statistics.median(times[k]),
                         "baseline_s": statistics.median(times["baseline"]), "oracle_s": statistics.median(times[k])})
    return rows


def _main(argv, name: str, description: str) -> None:
    ap = parser(name, description)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for every contender")
    args = ap.parse_args(argv)
    torch_setup(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_policy(Path(tmp) / "policy")
        bench = engine_vs_hf if name == "engine-vs-hf" else oracle_speedup
        print_rows(bench(ckpt, repeats=args.repeats))


def engine_vs_hf_main(argv=None) -> None:
    _main(argv, "engine-vs-hf", "torch_ref vs transformers generate, batch 1 and 32")


def oracle_main(argv=None) -> None:
    _main(argv, "oracle", "the oracle drafter's speedup, budgets 4/8/16, 256 tokens")
