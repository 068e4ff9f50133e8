"""The one speculation loop: the same drafter calls, iteration log and counters on torch_ref and the
simulator, and the policy's cap reaching the drafter (regressions of bugs the five loops had)."""
from __future__ import annotations

import pytest

from recording_drafter import recording

from bench.core.drafting import drafter_mode
from bench.core.engine_protocol import Request
from bench.core.sampling import SamplingConfig
from bench.harness.sim_replay import run_step
from bench.spec.recorded import recorded_rows
from bench.spec.recorded import Recorded, RecordedBackend
from bench.spec.scheduler import Scheduler
from bench.spec.policy import SpecPolicy
from bench.spec.policy_table import TableLookup
from bench.core.verify import VerifyConfig
from methods.base import Draft, NullDrafter, RolloutKey
from methods.baseline import Baseline
from methods.history_spec import HistorySpecDrafter
from methods.hybrid import HybridDrafter
from methods.prefix_reuse import PrefixReuseDrafter
from methods.seer import SeerDrafter
from methods.tree_cache import TreeCacheDrafter

SHAPE = ["iteration", "call", "live_rows", "rows", "run_ahead_rows", "query_tokens", "block_tokens",
         "context_sum", "context_max", "draft_tokens", "draft_budget", "accepted_tokens", "nodes_read"]
COUNTERS = ["token_ids", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
            "num_forward_passes", "finish_reason"]


def _policy(kind):
    return SpecPolicy(kind, max_rows=3)


def gpu_like_table(path=None):
    """A latency table shaped like a GPU's at small scale: a fixed cost per pass plus a little per
    query token and per context token read, so drafting pays for some rows and batches, not others."""
    import pandas as pd
    from bench.spec.latency import LatencyTable
    grid = [(r, q, c, 1e-3 + 2e-5 * r * q + 1e-7 * r * c) for r in (1, 4, 16, 64) for q in (1, 2, 4, 8, 16, 32, 64)
            for c in (8, 64, 512, 4096)]
    frame = pd.DataFrame(grid, columns=["rows", "query", "context", "seconds"])
    if path is not None:
        frame.to_csv(path, index=False)
    return LatencyTable(frame, "gpu-like")


DRAFTERS = ((TreeCacheDrafter, {}), (SeerDrafter, {"max_batch_draft_tokens": 8}), (HistorySpecDrafter, {}))


def _engine_against_simulator(trace, engine, sim_policy, prices=None, shape=SHAPE):
    """Each of ``DRAFTERS`` through every step on ``engine`` and on the simulator (one policy per
    drafter, as the engine keeps one per drafter): tokens, counters, the iteration log (``shape``
    columns) and every drafter call equal; returns the engine's recorded drafters and logs."""
    sampling = trace.sampling.to_config()
    out = []
    for cls, kw in DRAFTERS:
        on_engine, on_sim = recording(cls)(**kw), recording(cls)(**kw)
        policy, logs = sim_policy(), []
        for s in trace.steps:
            df = trace.rollouts(s.step)
            engine.load(trace.checkpoint(s.step))
            on_engine.begin_step(s.step)
            reqs = [Request(RolloutKey(p, int(i)), trace.prompts[p], s.step) for p, i in zip(df.prompt_id, df.sample_idx)]
            eng_out = engine.rollout(reqs, sampling, on_engine, VerifyConfig())
            eng_log = [{c: call[c] for c in shape} for call in engine.last_iteration_log]
            sim_log = []
            sim_out = run_step(on_sim, s.step, recorded_rows(df, sampling.max_new_tokens), trace.prompts,
                               sampling.max_new_tokens, policy=policy, prices=prices, iteration_log=sim_log)
            assert [r.token_ids for r in eng_out] == [list(t) for t in df.token_ids]  # the recording, replayed
            for c in COUNTERS:
                assert [getattr(r, c) for r in eng_out] == [getattr(r, c) for r in sim_out], (cls.__name__, c)
            assert eng_log == [{c: call[c] for c in shape} for call in sim_log], cls.__name__
            if prices is not None:  # priced seconds: the token times too
                assert [r.last_token_time for r in eng_out] == [r.last_token_time for r in sim_out]
            logs += eng_log
        assert on_engine.calls == on_sim.calls, cls.__name__
        out.append((on_engine, logs))
    engine.close()
    return out


@pytest.mark.slow
def test_engine_and_simulator_agree_under_throughput_optimal_on_table_prices(tiny_trace, tmp_path):
    """throughput_optimal decides from seconds; with every pass priced by one table and nothing else
    timed (torch_ref's engine.seconds=table, the simulator's prices) the engine and the simulator
    make the same decisions: the same drafter calls, caps, passes, forward seconds and counters."""
    from bench.engines.torch.engine import TorchRefEngine
    from bench.spec.prices import TablePrices
    from bench.traces.format import Trace
    gpu_like_table(tmp_path / "table.csv")
    engine = TorchRefEngine(dtype="float64", spec_policy="throughput_optimal", latency_table=str(tmp_path / "table.csv"),
                            seconds="table")
    table = gpu_like_table()
    runs = _engine_against_simulator(Trace.load(tiny_trace), engine, lambda: SpecPolicy("throughput_optimal", table=table),
                                     TablePrices(table), [*SHAPE, "forward_s", "verify_s"])
    budgets = {call["draft_budget"] for _, logs in runs for call in logs}
    assert 0 in budgets and any(b > 0 for b in budgets), budgets  # the policy drafted and declined


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fixed", "batch_threshold"])
def test_engine_and_simulator_drive_the_drafter_identically(tiny_trace, kind):
    """Every call a drafter gets, every pass's shape and every counter: the same on torch_ref (float64,
    the recorder's seed) and on the simulator over the recorded rollouts, for drafters that read
    the batch (Seer), adapt their length (RhymeRL) and insert in flight (SRT)."""
    from bench.engines.torch.engine import TorchRefEngine
    from bench.traces.format import Trace
    engine = TorchRefEngine(dtype="float64", spec_policy=kind, spec_max_rows=3)
    for on_engine, _ in _engine_against_simulator(Trace.load(tiny_trace), engine, lambda: _policy(kind)):
        assert any(c[0] == "begin_iteration" for c in on_engine.calls)
        if kind == "batch_threshold":  # above 3 live rows the drafter is not asked at all
            assert all(len(c[1]) <= 3 for c in on_engine.calls if c[0] == "begin_iteration")


class CapAt:
    """A speculation policy that lets every row verify at most ``k`` draft tokens, decided after the
    drafts are known (as throughput_optimal's ``choose`` does)."""

    kind, lookup, first_drafts_decided = "cap", None, False

    def __init__(self, k):
        self.k = k

    def start_call(self, who):
        pass

    def budget(self, rows, context):
        return None

    def choose(self, drafts, context, cap):
        return self.k

    def choose_first(self, drafts, rows, pending, context, cap):
        return cap

    def record(self, *a, **kw):
        pass


def _run(drafter, rows, policy, max_new=64):
    scheduler = Scheduler(RecordedBackend({r.key: r for r in rows}), policy)
    steps = scheduler.run([Request(r.key, [1, 2], 1) for r in rows], SamplingConfig(max_new_tokens=max_new),
                          drafter, VerifyConfig())
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, scheduler.iteration_log


def test_a_capped_draft_is_judged_by_what_was_verified():
    """RhymeRL's AIMD doubles its length after a fully accepted draft. Capped from 8 to 2 tokens
    by the policy and both verified tokens accepted, the next length is 16, not 4 (before the fix
    the drafter judged its untruncated 8 tokens, saw a mismatch and halved)."""
    text = list(range(10, 60))
    key = RolloutKey("p", 0)
    d = recording(HistorySpecDrafter)(min_match=1, window=3)
    d.begin_step(0)
    d.start(key, [1, 2])
    d.finish(key, _rollout(key, text))  # the last visit: the draft source
    d.begin_step(1)
    out, _ = _run(d, [Recorded(key, text, [0.0] * len(text), 0.0, "stop")], CapAt(2))
    assert out[0].token_ids == text
    proposals = [c for c in d.calls if c[0] == "propose" and c[4]]
    verified = [c for c in d.calls if c[0] == "verified"]
    assert verified and all(c[2] == 2 for c in verified)
    # proposal lengths: 2, 4, 8, 16 (doubling after each verified-and-accepted cut), never halving
    lengths = [len(c[4]) for c in proposals]
    assert lengths[:4] == [2, 4, 8, 16], lengths


def _rollout(key, tokens):
    from methods.base import Rollout
    return Rollout(key=key, step=0, prompt_token_ids=[1, 2], token_ids=list(tokens), logprobs=[0.0] * len(tokens),
                   finish_reason="stop")


def test_seer_never_hands_out_pool_tokens_past_the_policy_cap():
    """Seer's pool of 8 tokens, policy cap 2 per row: each of four rows gets 2 (all verified)
    instead of the first row taking the whole pool and the cap throwing 6 away."""
    seer = SeerDrafter(max_batch_draft_tokens=8, min_prob=0.0)
    keys = [RolloutKey("g", i) for i in range(5)]
    seer.begin_step(0)
    for k in keys:
        seer.start(k, [1, 2])
    seer.observe(keys[4], list(range(10, 30)))  # a sibling ahead: the group trie holds its tokens
    live = [(k, 0) for k in keys[:4]]
    for k in keys[:4]:
        seer.observe(k, [10, 11, 12])
    seer.begin_iteration([(k, 3) for k, _ in live], budget=2)
    drafts = [seer.propose(k, [10, 11, 12], 40) for k, _ in live]
    assert [len(d) for d in drafts] == [2, 2, 2, 2]


def test_table_lookup_survives_its_memo_being_cleared_mid_call():
    """A call mixing memo hits and misses once the memo passed its limit raised KeyError (seen at
    the 161st policy call of a main-job-shaped sequence: KeyError (113, 1, 510))."""

    class Table:
        def query_seconds(self, rows, queries, context):
            return [1e-3 * rows * q for q in queries]

    lookup = TableLookup(Table())
    lookup.LIMIT = 2
    assert lookup(4, [1, 2, 3], 100.0) == pytest.approx([4e-3, 8e-3, 12e-3])  # 3 entries: past the limit
    assert lookup(4, [1, 5], 100.0) == pytest.approx([4e-3, 20e-3])  # a hit and a miss: cleared in between
    assert lookup.one(4, 2, 100.0) == pytest.approx(8e-3)


def test_drafters_declare_what_they_draft():
    assert drafter_mode(Baseline()) == drafter_mode(NullDrafter()) == "baseline"
    assert drafter_mode(PrefixReuseDrafter()) == "prefix"
    assert drafter_mode(TreeCacheDrafter()) == drafter_mode(HybridDrafter()) == drafter_mode(SeerDrafter()) == "tree"

    class Custom(NullDrafter):  # overrides propose, declares nothing: drafts while decoding
        def propose(self, key, output, budget):
            return Draft([1])

    assert drafter_mode(Custom()) == "tree"
    with pytest.raises(TypeError, match="drafts must be one of"):
        type("Bad", (NullDrafter,), {"drafts": "sometimes"})


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fixed", "batch_threshold", "throughput_optimal"])
def test_the_simulator_cli_reproduces_a_cli_replay(tmp_path, policy):
    """``python -m bench.harness.cli`` on torch_ref (float64) and ``python -m bench.harness.simulate`` on the same
    trace and steps: every exact method's counters per rollout and its iteration log, pass for pass
    (throughput_optimal: both priced by one table, the forward seconds equal too)."""
    from bench.harness.sim_check import check
    methods = ["baseline", "prefix_reuse_exact", "tree_cache", "hybrid", "history_spec", "das", "seer"]
    csv = None
    if policy == "throughput_optimal":
        gpu_like_table(tmp_path / "table.csv")
        csv = str(tmp_path / "table.csv")
    table = check("countdown_tiny", methods, policy, spec_max_rows=4, dtype="float64", out=tmp_path, table=csv)
    assert sorted(table["method"]) == sorted(methods)
    assert (table["engine_emitted_recorded"] == table["rollouts"]).all()
    assert (table["counters_equal"] == table["rollouts"]).all(), table.to_string()
    assert table["iteration_log_equal"].all(), table.to_string()
    assert (table["passes_engine"] > 0).all()
