"""The verifier at real size: vocabulary 151,936 (Qwen2), batch 128, ragged trees and 4,096-token
chains: peak memory and seconds, against the previous verifier read from git beside the current.

    python -m bench.benchmarks verify-scale
"""
from __future__ import annotations
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
import torch
from methods.base import Draft
from bench.core.paths import REPO_ROOT
from bench.core.sampling import SamplingConfig, rollout_seed
from bench.core.verify import VerifyConfig
from bench.benchmarks.helpers import print_rows


QWEN2_VOCAB, QWEN2_HIDDEN = 151_936, 896  # Qwen2.5-0.5B's vocabulary and hidden size


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


# the verifier before bench.core.verify read ragged nodes in chunks (padded [B, K, V] logits, float64)
OLD_VERIFIER_REF = "8b6fa4db1481c7349c9045238317876b19fc782b"


def _old_verifier(ref: str):
    """The verifier and sampling modules as they were at git ``ref`` (then at the top of bench/, before
    bench/core/ existed), imported as a package of their own (``git show`` into a temporary folder),
    to run beside the current ones."""
    import importlib
    import subprocess
    import sys
    root = REPO_ROOT
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
    from bench.core import verify as new
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
    import subprocess
    import sys
    code = ("import json, sys; from bench.benchmarks.verify_scale import _scale_job; "
            "print('RESULT' + json.dumps(_scale_job(json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True,
                         timeout=timeout, cwd=str(REPO_ROOT))
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
    from bench.core import verify as new
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


def main(argv=None) -> None:
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
    print_rows(verify_scale_memory(batch=args.batch, old_batches=(args.old_batch, 2 * args.old_batch), chain=args.chain,
                               threads=args.threads, old_ref=args.old_ref))
    print("\ntime, previous vs current verifier on the same padded logits (one process, alternating):")
    print_rows(verify_scale_time(batch=args.old_batch, repeats=args.repeats, old_ref=args.old_ref))
