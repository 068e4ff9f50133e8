"""The drafter's share of rollout seconds on a trace: the harness must not be drafter-bound, or a
method's speedup measures its Python rather than its drafts.

    python -m bench.benchmarks drafter-cost [--trace countdown-search] [--steps 12] [--backend native]
"""
from __future__ import annotations
import time
from bench.core.paths import METHOD_CONF_DIR
from bench.engines.torch.engine import TorchRefEngine
from bench.core.verify import VerifyConfig
from bench.benchmarks.helpers import parser
from bench.benchmarks.helpers import print_rows
from bench.benchmarks.helpers import torch_setup


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
    the tokens per forward pass (output tokens / each rollout's passes, docs/results.md) and
    the batch's forward passes (engine iterations). A sparse trace (the main job's default) is
    replayed as the main job does: the rollouts-only steps before a checkpoint are fed to the
    drafter first (``bench.harness.replay.feed_recorded``, not timed). ``backend`` / ``match`` override
    those knobs of the methods that have them (the suffix-tree backend, the match rule);
    ``methods`` keeps only those configs (default: every exact method without run-ahead)."""
    from omegaconf import OmegaConf
    import hydra.utils
    from bench.traces.record.cache import ensure_trace
    from bench.harness.replay import feed_recorded, step_requests
    from bench.traces.format import Trace
    trace = Trace.load(ensure_trace(trace_name, tiny=trace_name.endswith("tiny")))
    conf = METHOD_CONF_DIR
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


def main(argv=None) -> None:
    ap = parser("drafter-cost", "drafter seconds as a share of rollout seconds, on a trace")
    ap.add_argument("--trace", default="countdown-search", help="the trace to replay (default: the main job's)")
    ap.add_argument("--steps", type=int, default=12, help="steps to replay")
    ap.add_argument("--backend", default=None, choices=["auto", "python", "native"],
                    help="the tree drafters' backend knob (default: each config's)")
    ap.add_argument("--match", default=None, choices=["longest", "best"],
                    help="the match rule of the methods that have one")
    ap.add_argument("--methods", default=None, help="only these methods (comma-separated)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch_setup(args.threads)
    print_rows(drafter_cost(args.trace, args.steps, backend=args.backend, match=args.match,
                            methods=args.methods.split(",") if args.methods else None))
