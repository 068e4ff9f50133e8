"""Offline simulation: literal recorded rollouts, log folders, refusals, and agreement with the real engine."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from omegaconf import OmegaConf

from bench.harness.sim_cache_oracle import oracle_passes
from bench.harness.sim_inputs import load_input
from bench.harness.sim_methods import FUTURE_ORACLE, SimulationError, method_config, simulable_methods
from bench.harness.sim_replay import simulate
from bench.harness.sim_summary import summarize
from bench.harness.sim_synthetic import synthetic_log
from bench.harness.simulate import main
from methods.base import NO_DRAFT, Draft, NullDrafter
from methods.oracle import SuffixAutomaton

EOS = 1


def step_table(rows):
    """rows: (prompt_id, sample_idx, tokens) -> a recorded step table."""
    return pd.DataFrame({"prompt_id": [r[0] for r in rows], "sample_idx": [r[1] for r in rows],
                         "token_ids": [list(r[2]) for r in rows]})


# two prompts, two samples each; every response ends with EOS
STEP0 = step_table([("a", 0, [5, 6, 7, 8, 9, EOS]), ("a", 1, [5, 6, 3, EOS]),
                    ("b", 0, [4, 4, 4, 2, EOS]), ("b", 1, [2, 3, EOS])])


def metrics(rows, method):
    return summarize(rows).set_index("method").loc[method]


def test_future_oracle_accepts_every_token_and_baseline_none():
    rows = simulate({0: STEP0}, {}, {FUTURE_ORACLE: method_config(FUTURE_ORACLE),
                                     "baseline": method_config("baseline")}, max_new_tokens=16)
    oracle, base = metrics(rows, FUTURE_ORACLE), metrics(rows, "baseline")
    # the oracle drafts each whole future (budget 15 >= every length - 1): one pass per rollout
    assert (rows[rows.method == FUTURE_ORACLE]["num_forward_passes"] == 1).all()
    assert oracle["acceptance_rate"] == 1.0
    assert oracle["tokens_per_step"] == pytest.approx(STEP0["token_ids"].map(len).mean())
    assert base["tokens_per_step"] == 1.0 and base["num_drafts"] == 0
    assert rows.groupby("method")["output_len"].sum().tolist() == [18, 18]


def test_future_oracle_is_capped_by_the_engine_budget():
    long = step_table([("a", 0, list(range(2, 12)))])  # 10 tokens, max_new_tokens 10: a length finish
    rows = simulate({0: long}, {}, {FUTURE_ORACLE: method_config(FUTURE_ORACLE)}, max_new_tokens=10)
    r = rows.iloc[0]
    # budget max_new_tokens - 0 - 1 = 9 drafted and accepted, plus the bonus: one pass
    assert (r.num_draft_tokens, r.num_accepted_tokens, r.num_forward_passes) == (9, 9, 1)
    assert r.num_accepted_tokens_per_pos == [1] * 9 and r.finish_reason == "length"


class Fixed(NullDrafter):
    """Proposes the same draft at output length 0 only."""

    def __init__(self, draft):
        self.draft = draft

    def propose(self, key, output, budget):
        return self.draft if not output else Draft()


def test_chain_and_tree_acceptance_follow_the_recorded_tokens():
    one = {0: step_table([("a", 0, [5, 6, 7, 8, EOS])])}
    # chain [5, 6, 9]: 5 and 6 match, 9 != 7 -> 2 accepted, emitted 5 6 7; then 8, EOS one by one
    rows = simulate(one, {}, {"chain": Fixed(Draft([5, 6, 9]))}, 16)
    r = rows.iloc[0]
    assert (r.num_drafts, r.num_draft_tokens, r.num_accepted_tokens, r.num_forward_passes) == (1, 3, 2, 3)
    assert r.num_accepted_tokens_per_pos == [1, 1]
    # tree: decoy 4 first, then 5 -> (decoy 9, 6 -> 7): the deepest matching path is 5 6 7
    tree = Draft([4, 5, 9, 6, 7], [-1, -1, 1, 1, 3])
    r = simulate(one, {}, {"tree": Fixed(tree)}, 16).iloc[0]
    assert (r.num_draft_tokens, r.num_accepted_tokens, r.num_forward_passes) == (5, 3, 2)
    # a draft running past the recorded end: accepted up to EOS, nothing emitted after it
    r = simulate(one, {}, {"past": Fixed(Draft([5, 6, 7, 8, EOS, 3, 3]))}, 16).iloc[0]
    assert (r.num_accepted_tokens, r.num_forward_passes, r.output_len) == (5, 1, 5)


def test_tree_cache_benefits_from_an_earlier_identical_rollout():
    again = step_table([("a", 0, [5, 6, 7, 8, 9, EOS])])
    steps = {0: step_table([("a", 0, [5, 6, 7, 8, 9, EOS])]), 1: again}
    rows = simulate(steps, {}, {"tree_cache": method_config("tree_cache")}, 16)
    by_step = summarize(rows, per_step=True).set_index("step")
    # step 0: an empty trie, one token per pass; step 1: the same response drafted from step 0's
    assert by_step.loc[0, "tokens_per_step"] == 1.0
    assert by_step.loc[1, "tokens_per_step"] > 1.5
    assert by_step.loc[1, "acceptance_rate"] == 1.0
    # and with nothing in between, a different prompt gets nothing from it
    other = {0: steps[0], 1: step_table([("b", 0, [5, 6, 7, 8, 9, EOS])])}
    rows = simulate(other, {}, {"tree_cache": method_config("tree_cache")}, 16)
    assert summarize(rows, per_step=True).set_index("step").loc[1, "tokens_per_step"] == 1.0


def test_cache_oracle_tokens_per_step_on_a_literal_cache():
    steps = {0: step_table([("a", 0, [1, 2, 3, 4, EOS])]), 1: step_table([("a", 0, [1, 2, 3, 9, EOS])])}
    hist = oracle_passes(steps, 16, in_flight=False)
    # step 0: empty cache, 5 passes; step 1: [1, 2, 3] occurs in the cache -> 3 + bonus 9, then EOS
    assert hist == {(0, "a", 0): 5, (1, "a", 0): 2}
    # in flight, a rollout repeating itself helps itself: [7, 7, 7, 7, EOS] -> 7 | 7 | 7 7 + EOS
    rep = {0: step_table([("a", 0, [7, 7, 7, 7, EOS])])}
    assert oracle_passes(rep, 16, in_flight=True) == {(0, "a", 0): 3}
    assert oracle_passes(rep, 16, in_flight=False) == {(0, "a", 0): 5}
    # capped by the method's budget: at most 2 draft tokens, step 1 is 1 2 + bonus 3 | 9 | EOS
    assert oracle_passes(steps, 16, in_flight=False, budget=2)[(1, "a", 0)] == 3
    table = summarize(simulate(steps, {}, {"prefix_reuse_exact": method_config("prefix_reuse_exact"),
                                           "history_spec": method_config("history_spec"),
                                           "baseline": method_config("baseline"),
                                           FUTURE_ORACLE: method_config(FUTURE_ORACLE)}, 16)).set_index("method")
    # each method's oracle under its own cache and budget: the engine's (prefix reuse), 16, none
    assert table.loc["prefix_reuse_exact", "cache_oracle_tokens_per_step"] == pytest.approx(10 / 7)
    assert table.loc["prefix_reuse_exact", "cache_oracle"] == "prompt, finished, budget engine"
    assert table.loc["history_spec", "cache_oracle"] == "prompt, finished, budget engine"  # 16 >= 15
    assert table.loc["baseline", "cache_oracle_tokens_per_step"] == 1.0
    assert table.loc["baseline", "cache_oracle"] == "no cache (budget 0)"
    # the future oracle knows the future: no cache bounds it, the column is blank
    assert pd.isna(table.loc[FUTURE_ORACLE, "cache_oracle_tokens_per_step"])
    assert table.loc[FUTURE_ORACLE, "cache_oracle"] == ""


def _automata():
    from methods.suffix.compiled import CompiledAutomaton
    unbuilt = pytest.mark.skipif(CompiledAutomaton is None,
                                 reason="the compiled index was not built (no C compiler at install)")
    return [SuffixAutomaton, pytest.param(lambda: CompiledAutomaton(1), marks=unbuilt),
            pytest.param(lambda: CompiledAutomaton(1, counts=False), marks=unbuilt)]


@pytest.mark.parametrize("make", _automata(), ids=["python", "compiled", "compiled_transitions_only"])
def test_suffix_automaton_finds_every_substring_of_interleaved_texts(make):
    """The cache oracle's walk on either automaton (the compiled one is what it runs on where built)."""
    import random
    rng = random.Random(1)

    def longest(texts, seq, start, limit):
        m = 0
        while m < min(limit, len(seq) - start) and any(
                seq[start:start + m + 1] == t[i:i + m + 1] for t in texts for i in range(len(t))):
            m += 1
        return m

    for vocab in (2, 3, 50):
        sam, texts, tokens = make(), {}, 0
        for _ in range(60):  # texts grown in random interleavings, as in-flight rollouts are
            tid = rng.randrange(4)
            toks = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            sam.extend(tid, toks)
            tokens += len(toks)
            texts.setdefault(tid, []).extend(toks)
            for _ in range(4):
                q = [rng.randrange(vocab) for _ in range(rng.randint(0, 9))]
                start, limit = rng.randint(0, len(q)), rng.randint(0, 10)
                assert sam.longest_prefix(q, start, limit) == longest(list(texts.values()), q, start, limit)
        assert (sam.num_states if make is SuffixAutomaton else sam.num_nodes) <= 2 * tokens + 1


def test_transitions_only_automaton_refuses_what_needs_counts_and_is_smaller():
    """The cache oracle's automaton keeps transitions only: the queries that read counts or texts
    say so, and it holds well under the counted one's bytes for the same text."""
    import pickle
    import random
    from methods.suffix.compiled import CompiledAutomaton
    if CompiledAutomaton is None:
        pytest.skip("the compiled index was not built (no C compiler at install)")
    rng = random.Random(0)
    text = [rng.randrange(151_936) for _ in range(5000)]
    lean, counted = CompiledAutomaton(1, counts=False), CompiledAutomaton(1)
    for a in (lean, counted):
        a.extend(0, text)
    assert lean.num_nodes == counted.num_nodes
    assert lean.approx_bytes() < 0.6 * counted.approx_bytes()
    for call in (lambda: lean.sequence(0), lambda: lean.remove(0), lambda: lean.count_of(0),
                 lambda: pickle.dumps(lean)):
        with pytest.raises(ValueError, match="counts=False"):
            call()
    with pytest.raises(ValueError, match="only on a new automaton"):
        counted.__init__(1, counts=False)


def test_cache_oracle_memory_is_linear_in_the_rollout():
    """One 2,000-token rollout: at most 2n states and 3n transitions, where a suffix trie of
    depth max_new_tokens (the old oracle) has n(n+1)/2, about two million nodes."""
    import random
    rng = random.Random(0)
    n = 2000
    for vocab in (151_936, 3):  # all distinct runs, and a highly repetitive text
        sam = SuffixAutomaton()
        sam.extend(0, [rng.randrange(vocab) for _ in range(n)])
        assert sam.num_states <= 2 * n and sam.num_transitions <= 3 * n
        assert sam.approx_bytes() < 200 * n


def _bounded(rows):
    """Per rollout: the cache oracle needs no more forward passes than the method it is beside."""
    rows = rows[rows.method != FUTURE_ORACLE]
    bad = rows[rows.cache_oracle_num_forward_passes > rows.num_forward_passes]
    assert bad.empty, bad[["method", "step", "prompt_id", "sample_idx", "num_forward_passes",
                           "cache_oracle_num_forward_passes"]].head()
    table = summarize(rows).set_index("method")
    assert (table["cache_oracle_tokens_per_step"] >= table["tokens_per_step"]).all()
    return table


def test_cache_oracle_bounds_every_method_on_a_synthetic_log():
    steps, prompts = synthetic_log(steps=3, prompts=3, samples=4, max_len=192, median_len=96,
                                   event_rate=0.05, vocab=500, seed=3)
    names = simulable_methods()
    rows = simulate(steps, prompts, {n: method_config(n) for n in names}, 192)
    table = _bounded(rows)
    assert set(table.index) == set(names) - {FUTURE_ORACLE}
    # drafting methods gain here, and the future oracle is above every cache oracle
    assert table.loc["tree_cache", "tokens_per_step"] > 1.5
    future = summarize(rows).set_index("method").loc[FUTURE_ORACLE, "tokens_per_step"]
    assert future >= table["cache_oracle_tokens_per_step"].max()
    # tighter budgets give lower bounds: history_spec (16) below prefix_reuse_exact (engine), same cache
    assert table.loc["history_spec", "cache_oracle"] == "prompt, finished, budget 16"
    assert (table.loc["history_spec", "cache_oracle_tokens_per_step"]
            < table.loc["prefix_reuse_exact", "cache_oracle_tokens_per_step"])
    assert NO_DRAFT == Draft()  # every method ran: none changed the shared empty draft


def test_copying_is_every_simulable_method_but_the_learned_drafters():
    from bench.harness.sim_methods import runs_a_model
    every, copying = simulable_methods(), simulable_methods(copying_only=True)
    learned = [m for m in every if m not in copying]
    assert copying == [m for m in every if m in copying]  # same order, a subset
    assert {"draft_lm", "learned_tree"} <= set(learned) and {"tree_cache", "das", FUTURE_ORACLE} <= set(copying)
    assert all(runs_a_model(method_config(m)) for m in learned)
    assert not any(runs_a_model(method_config(m)) for m in copying if m != FUTURE_ORACLE)


@pytest.mark.slow
def test_cache_oracle_bounds_every_method_on_the_tiny_trace(tiny_trace):
    steps, prompts, max_new = load_input(tiny_trace)
    names = simulable_methods()
    _bounded(simulate(steps, prompts, {n: method_config(n) for n in names}, max_new))


def test_log_folder_jsonl_and_parquet(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    with open(logs / "step_3.jsonl", "w") as f:
        for pid, idx, toks in zip(STEP0.prompt_id, STEP0.sample_idx, STEP0.token_ids):
            f.write(json.dumps({"prompt_id": pid, "sample_idx": int(idx), "token_ids": toks,
                                "prompt_token_ids": [9, 9]}) + "\n")
    STEP0.to_parquet(logs / "step_00004.parquet")
    (logs / "notes.txt").write_text("ignored")
    steps, prompts, max_new = load_input(logs)
    assert sorted(steps) == [3, 4] and prompts == {"a": [9, 9], "b": [9, 9]} and max_new is None
    out = tmp_path / "table.csv"
    main([str(logs), "--method", "tree_cache", "--method", "baseline", "--out", str(out)])
    table = pd.read_csv(out)
    assert set(table["method"]) == {"tree_cache", "baseline"} and sorted(set(table["step"])) == [3, 4]
    out = capsys.readouterr().out
    assert "cache_oracle_tokens_per_step" in out and "future_oracle: drafts each rollout's recorded future" in out


def test_folder_without_trace_or_logs_is_one_clear_error(tmp_path):
    (tmp_path / "rollouts.csv").write_text("x")
    with pytest.raises(SimulationError, match="neither a trace") as err:
        load_input(tmp_path)
    assert str(tmp_path) in str(err.value) and "step_<N>.jsonl" in str(err.value)
    with pytest.raises(SystemExit, match="neither a trace"):
        main([str(tmp_path), "--method", "baseline"])
    pd.DataFrame({"prompt_id": ["a"], "tokens": [[1]]}).to_parquet(tmp_path / "step_1.parquet")
    with pytest.raises(SimulationError, match=r"lacks columns \['sample_idx', 'token_ids'\]"):
        load_input(tmp_path)


def test_ratio_rule_is_refused():
    with pytest.raises(SimulationError, match="needs exact verification.*prefix_reuse_exact"):
        simulate({0: STEP0}, {}, {"prefix_reuse": method_config("prefix_reuse")}, 16)
    cfg = OmegaConf.create({"drafter": {"_target_": "methods.baseline.Baseline"},
                            "verify": {"rule": "ratio", "lenience": 1.0}})
    with pytest.raises(SimulationError, match="verify.rule=ratio"):
        simulate({0: STEP0}, {}, {"custom": cfg}, 16)
    # the exact-rule config of the same cache simulates
    rows = simulate({0: STEP0, 1: STEP0}, {}, {"prefix_reuse_exact": method_config("prefix_reuse_exact")}, 16)
    assert metrics(rows, "prefix_reuse_exact")["acceptance_rate"] == 1.0  # step 1 repeats step 0


# ---------------------------------------------------------------- agreement with the engine

# (method, drafter overrides, history only). Given identical tokens the engine and the simulation
# call the drafter in the same order, so in-flight methods agree exactly too (seen on the tiny trace).
CASES = [("history_spec", {}, True), ("prefix_reuse_exact", {}, True), ("tree_cache", {"in_flight": False}, True),
         ("tree_cache", {}, False), ("hybrid", {}, False), ("suffix_global", {}, False), ("das", {}, False),
         ("seer", {}, False), ("seer", {"max_batch_draft_tokens": 8}, False)]
COUNTERS = ["num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_forward_passes"]


def _cfg(name, overrides):
    cfg = method_config(name)
    for k, v in overrides.items():
        cfg.drafter[k] = v
    return cfg


def _engine_counters(trace, cfg):
    """Replay every step on the torch reference engine in float64 with the trace's sampling and seed."""
    from hydra.utils import instantiate

    from bench.core.engine_protocol import Request
    from bench.engines.torch.engine import TorchRefEngine
    from bench.core.verify import VerifyConfig
    from methods.base import RolloutKey

    engine = TorchRefEngine(dtype="float64")
    sampling = trace.sampling.to_config()
    drafter = instantiate(cfg.drafter)
    rows = []
    for s in trace.steps:
        df = trace.rollouts(s.step)
        engine.load(trace.checkpoint(s.step))
        drafter.begin_step(s.step)
        reqs = [Request(RolloutKey(p, int(i)), trace.prompts[p], s.step) for p, i in zip(df.prompt_id, df.sample_idx)]
        for rec, r in zip(df.token_ids, engine.rollout(reqs, sampling, drafter, VerifyConfig())):
            rows.append({"step": s.step, "prompt_id": r.key.prompt_id, "sample_idx": r.key.sample_idx,
                         "same_tokens": list(rec) == r.token_ids, "num_accepted_tokens_per_pos":
                         r.num_accepted_tokens_per_pos, **{c: getattr(r, c) for c in COUNTERS}})
    engine.close()
    return pd.DataFrame(rows)


@pytest.mark.slow
def test_simulation_matches_the_engine_on_the_tiny_trace(tiny_trace):
    from bench.traces.format import Trace
    trace = Trace.load(tiny_trace)
    steps, prompts, max_new = load_input(tiny_trace)
    keys = ["step", "prompt_id", "sample_idx"]
    # first: a baseline replay with the recorder's seed reproduces the recorded rollouts token for token
    base = _engine_counters(trace, method_config("baseline"))
    assert base["same_tokens"].all(), f"{(~base.same_tokens).sum()} rollouts differ from the recording"
    for name, over, history_only in CASES:
        cfg = _cfg(name, over)
        eng = _engine_counters(trace, cfg)
        sim = simulate(steps, prompts, {name: cfg}, max_new)
        both = eng.merge(sim, on=keys, suffixes=("_eng", "_sim"))
        assert len(both) == len(eng) == len(sim) and both["same_tokens"].all()
        diff = (both["num_accepted_tokens_eng"] - both["num_accepted_tokens_sim"]).abs()
        kind = "history only" if history_only else "in flight"
        print(f"{name} {over} ({kind}): engine accepted {both.num_accepted_tokens_eng.sum()}, simulation "
              f"{both.num_accepted_tokens_sim.sum()}, rollouts differing {int((diff > 0).sum())}/{len(both)}")
        for c in COUNTERS + ["num_accepted_tokens_per_pos"]:
            assert both[f"{c}_eng"].tolist() == both[f"{c}_sim"].tolist(), (name, c)


def test_a_simulated_schedule_priced_through_a_hand_made_table():
    """One rollout [5, 6, 7, 8, EOS] after a 2-token prompt. The baseline's schedule: a prefill of
    2 tokens, then 4 one-token passes; the future oracle's: one pass of 2 + 5 tokens. A table of
    1 ms per query token (any rows, any context) prices them at 6 ms and 7 ms."""
    from bench.spec.latency import LatencyTable, predict_iterations
    step = step_table([("a", 0, [5, 6, 7, 8, EOS])])
    rows = simulate({0: step}, {"a": [9, 9]}, {"baseline": method_config("baseline"),
                                              FUTURE_ORACLE: method_config(FUTURE_ORACLE)}, max_new_tokens=16)
    it = rows.attrs["iterations"]
    base = it[it.method == "baseline"]
    assert base["block_tokens"].tolist() == [2, 1, 1, 1, 1] and base["context_sum"].tolist() == [2, 3, 4, 5, 6]
    assert it[it.method == FUTURE_ORACLE]["block_tokens"].tolist() == [7]
    grid = [(r, q, c, 1e-3 * q) for r in (1, 2) for q in (1, 2, 4) for c in (1, 100)]
    table = LatencyTable(pd.DataFrame(grid, columns=["rows", "query", "context", "seconds"]), "hand")
    per = predict_iterations(it, table, host="none").set_index("method")
    assert per.loc["baseline", "predicted_s"] == pytest.approx(6e-3)
    assert per.loc[FUTURE_ORACLE, "predicted_s"] == pytest.approx(7e-3)  # 7 query tokens: extrapolated
    assert per.loc[FUTURE_ORACLE, "predicted_speedup"] == pytest.approx(6 / 7)
    assert per.loc["baseline", "predicted_tail_share"] == 1.0  # one live row: all of it is the tail


def test_the_simulator_cli_prints_and_writes_predictions(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    STEP0.assign(prompt_token_ids=[[9, 9]] * len(STEP0)).to_parquet(logs / "step_00001.parquet")
    out = tmp_path / "table.csv"
    main([str(logs), "--method", "tree_cache", "--predict", "h200:llama-3.1-8b", "--out", str(out)])
    table = pd.read_csv(out)
    assert set(table["method"]) == {"baseline", "tree_cache"}  # the baseline added for the speedups
    col = "predicted_speedup [roofline h200 x llama-3.1-8b]"
    assert col in table and (table[table.method == "baseline"][col] == 1.0).all()
    assert "Predicted (not measured)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="give HARDWARE:MODEL"):
        main([str(logs), "--method", "tree_cache", "--predict", "h200"])


def test_throughput_optimal_is_simulated_by_one_targets_prices(tmp_path, capsys):
    """The policy decides by the roofline of the one named GPU (or a table); zero or two targets
    are refused, since each target would schedule differently."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for step in (1, 2):
        STEP0.assign(prompt_token_ids=[[9, 9]] * len(STEP0)).to_parquet(logs / f"step_{step:05d}.parquet")
    it = tmp_path / "it.parquet"
    main([str(logs), "--method", "tree_cache", "--policy", "throughput_optimal", "--predict", "h200:llama-3.1-8b",
          "--iterations-out", str(it)])
    log = pd.read_parquet(it)
    assert (log["forward_s"] > 0).all() and (log["drafter_s"] == 0).all()  # priced passes, nothing else timed
    assert (log[log.method == "tree_cache"]["draft_budget"] != -1).all()  # the policy set every cap
    for extra in ([], ["--predict", "h200:llama-3.1-8b", "--predict", "h100_sxm:qwen2.5-7b"]):
        with pytest.raises(SystemExit, match="throughput_optimal"):
            main([str(logs), "--method", "tree_cache", "--policy", "throughput_optimal", *extra])


def test_a_roofline_read_as_a_table_is_the_roofline():
    from bench.spec.roofline import Hardware, ModelShape, RooflineTable, roofline_seconds
    hw, model = Hardware.named("h200"), ModelShape.named("llama-3.1-8b")
    table = RooflineTable(hw, model)
    got = table.query_seconds(8, [1, 4], 512.0)
    want = roofline_seconds(hw, model, [8, 32], [8 * 512.0] * 2, [8, 8]).tolist()
    assert got == pytest.approx(want) and got[1] == got[0]  # 8 rows: memory-bound, 4 query tokens are free
    plain, wide = table.query_seconds(256, [1, 64], 2048.0)
    assert wide > 4 * plain  # 256 rows x 64 query tokens: compute-bound, drafting costs


def test_methods_in_processes_give_the_serial_result():
    steps, prompts = synthetic_log(steps=2, prompts=3, samples=4, max_len=256, median_len=96, vocab=5000)
    cfgs = {n: method_config(n) for n in ("baseline", "tree_cache", "history_spec", "seer")}
    serial = simulate(steps, prompts, cfgs, max_new_tokens=256, policy="batch_threshold", spec_max_rows=6)
    spread = simulate(steps, prompts, cfgs, max_new_tokens=256, policy="batch_threshold", spec_max_rows=6, jobs=2)
    pd.testing.assert_frame_equal(serial, spread)
    shape = [c for c in serial.attrs["iterations"] if not c.endswith("_s")]  # seconds are measured
    pd.testing.assert_frame_equal(serial.attrs["iterations"][shape], spread.attrs["iterations"][shape])
    assert set(spread.attrs["timings"]) >= set(cfgs)
    # each distinct cache oracle ran once (tree_cache and seer share theirs), as in the serial run
    oracles = [[k for k in frame.attrs["timings"] if k.startswith("cache oracle")] for frame in (serial, spread)]
    assert sorted(oracles[0]) == sorted(oracles[1]) and len(oracles[1]) == 3
    with pytest.raises(SimulationError, match="jobs must be >= 1"):
        simulate(steps, prompts, cfgs, max_new_tokens=256, jobs=0)


def test_the_simulator_draws_its_predictions(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for step in (1, 2):
        STEP0.assign(prompt_token_ids=[[9, 9]] * len(STEP0)).to_parquet(logs / f"step_{step:05d}.parquet")
    main([str(logs), "--method", "tree_cache", "--predict", "h200:llama-3.1-8b", "--figures", str(tmp_path / "f")])
    names = sorted(p.name for p in (tmp_path / "f").iterdir())
    assert names == ["live_rows__h200-x-llama-3.1-8b.png", "predicted_speedup.png"]
    assert all((tmp_path / "f" / n).stat().st_size > 10_000 for n in names)
    with pytest.raises(SystemExit, match="--figures draws predictions"):
        main([str(logs), "--method", "tree_cache", "--figures", str(tmp_path / "g")])


def test_simulate_scale_reports_every_copying_method_with_its_tokens_per_second(capsys):
    """The scale benchmark's run of ``copying`` in two processes, on a log small enough for a test:
    one row per method simulated, each with its tokens per second, none failed."""
    from bench.benchmarks.simulate_scale import simulate_scale
    rows = simulate_scale(methods=["copying"], probe=[], steps=2, prompts=2, samples=4, max_len=1024, jobs=2)
    together, parts = rows[0], [r for r in rows if r["run"].strip() == "its part"]
    assert together["status"] == 0 and together["run"].endswith("2 processes"), together
    assert [r["methods"] for r in parts] == simulable_methods(copying_only=True)
    assert all(r["parts"].endswith("k tokens/s") or (r["wall_s"] == 0 and "too fast" in r["parts"]) for r in parts)
    assert parts[0]["methods"] == "baseline" and parts[0]["parts"].endswith("k tokens/s")  # ~16k tokens: > 0.01 s
