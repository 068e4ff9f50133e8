"""Counts to wall clock: the iteration log, latency tables, the roofline, prediction and the
speculation policies (which must never change what an exact method emits)."""
import math

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from bench.harness.cli import CONF_DIR, run
from bench.core.errors import UserError
from bench.report.prediction import predict
from bench.spec.latency import LatencyTable
from bench.spec.roofline import Hardware, ModelShape, roofline_seconds
from bench.report.results import RunWriter, load_iterations, load_run
from bench.spec.policy import SpecPolicy
from bench.spec.policy_acceptance import AcceptanceTracker


def cfg_for(*overrides):
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("bench", overrides=["trace=countdown_tiny", "progress=false", "plots=false",
                                           "predict=[]", *overrides])


def outputs(run_dir, method):
    _, _, rows, _ = load_run(run_dir)
    rows = rows[(rows["method"] == method) & ~rows["run_ahead"].astype(bool)]
    rows = rows.sort_values(["step", "prompt_id", "sample_idx"])
    return [list(t) for t in rows["output_tokens"]]


def grid_table(fn, rows=(1, 4, 16), query=(1, 5, 25), context=(16, 64)) -> LatencyTable:
    """A full-grid table whose seconds are fn(rows, query, context)."""
    frame = pd.DataFrame([{"rows": r, "query": q, "context": c, "seconds": fn(r, q, c)}
                          for r in rows for q in query for c in context])
    return LatencyTable(frame, "hand-made")


def test_iteration_rows_sum_to_the_units_counters(tmp_path):
    run_dir = run(cfg_for("method=[baseline,tree_cache,tree_cache_runahead]", "max_steps=3",
                          f"results_root={tmp_path}"))
    _, _, rows, steps = load_run(run_dir)
    it = load_iterations(run_dir)
    assert len(it) and set(it["method"]) == {"baseline", "tree_cache", "tree_cache_runahead"}
    sums = it.groupby(["step", "method"]).agg(draft=("draft_tokens", "sum"), acc=("accepted_tokens", "sum"),
                                              iters=("iteration", "nunique"))
    # the engine's forward passes cover trained and run-ahead rows alike
    every = rows.groupby(["step", "method"])[["num_draft_tokens", "num_accepted_tokens"]].sum()
    joined = sums.join(every).join(steps.set_index(["step", "method"])["forward_passes"])
    assert (joined["draft"] == joined["num_draft_tokens"]).all()
    assert (joined["acc"] == joined["num_accepted_tokens"]).all()
    assert (joined["iters"] == joined["forward_passes"]).all()
    assert (it["rows"] >= 1).all() and (it["block_tokens"] >= it["query_tokens"]).all()
    assert (it["query_tokens"] >= it["rows"] + it["draft_tokens"]).all()
    # the seconds of a unit's iterations add up to about its measured wall time
    secs = it[["forward_s", "verify_s", "drafter_s", "other_s"]].sum(axis=1).groupby([it["step"], it["method"]]).sum()
    wall = steps.set_index(["step", "method"])["wall_s"]
    ratio = (secs / wall.reindex(secs.index)).to_numpy()
    assert (ratio > 0.5).all() and (ratio <= 1.0001).all()


@pytest.mark.parametrize("policy", ["batch_threshold", "throughput_optimal"])
def test_every_policy_leaves_exact_methods_token_identical(tmp_path, policy):
    exact = ["tree_cache", "hybrid", "history_spec", "prefix_reuse_exact"]
    extra = ["engine.spec_max_rows=6"]
    if policy == "throughput_optimal":  # drafting pays with few rows, not with many
        path = tmp_path / "table.csv"
        grid_table(lambda r, q, c: 1e-3 * (1 + 0.02 * r * q)).frame.to_csv(path, index=False)
        extra = [f"engine.latency_table={path}"]
    run_dir = run(cfg_for("method=[baseline," + ",".join(exact) + "]", "engine.dtype=float64",
                          "max_steps=3", f"engine.spec_policy={policy}", *extra, f"results_root={tmp_path}"))
    base = outputs(run_dir, "baseline")
    for m in exact:
        assert outputs(run_dir, m) == base, f"{m} under {policy} is not token-identical to the baseline"
    it = load_iterations(run_dir)
    drafted = it[it["method"] != "baseline"]
    assert drafted["draft_tokens"].sum() > 0  # the policy let some drafting through ...
    if policy == "batch_threshold":  # ... and none while more than 6 rows were live
        assert drafted.loc[drafted["live_rows"] > 6, "draft_tokens"].sum() == 0
    else:
        assert (drafted["draft_budget"] >= 0).all()
        assert drafted.loc[drafted["live_rows"] > 10, "draft_tokens"].sum() < drafted["draft_tokens"].sum()


def test_throughput_optimal_picks_the_budget_a_hand_computation_picks():
    flat = grid_table(lambda r, q, c: 1e-3)  # verifying more costs nothing: draft as much as offered
    steep = grid_table(lambda r, q, c: 1e-3 * q)  # k tokens cost k passes: never worth it
    for table, accept, want in ((flat, 0.9, 64), (steep, 0.5, 0)):
        policy = SpecPolicy("throughput_optimal", table=table)
        for _ in range(50):
            policy.record(8, 8 if accept > 0.8 else 4)
        assert policy.budget(4, 32.0) == want
    tracker = AcceptanceTracker()
    tracker.record(2, 1)  # position 0 accepted, position 1 offered and rejected
    # rates with the uniform prior: (1+1)/(1+2) = 2/3 and (0+1)/(1+2) = 1/3
    assert tracker.expected_tokens(2) == pytest.approx(1 + 2 / 3 + 2 / 3 * 1 / 3)


def test_latency_table_interpolates_and_extrapolates_in_log_space():
    table = grid_table(lambda r, q, c: 1e-4 * r * q)  # a power law is exact in log-log space
    got = table.seconds([1, 4, 2, 64, 16], [1, 5, 3, 25, 100], [16, 64, 32, 16, 64])
    assert got == pytest.approx([1e-4, 2e-3, 6e-4, 0.16, 0.16], rel=1e-9)
    with pytest.raises(UserError, match="full grid"):
        LatencyTable(table.frame.iloc[1:], "holey")


def test_predict_on_a_hand_made_log_gives_the_hand_computed_seconds(tmp_path):
    writer = RunWriter(tmp_path / "run", {"trace": {"name": "t"}, "engine": {"name": "torch_ref"}})
    def it_row(i, rows, query, context, host):
        return {"iteration": i, "call": 0, "rows": rows, "live_rows": rows, "run_ahead_rows": 0,
                "query_tokens": rows * query, "block_tokens": rows * query, "context_sum": rows * context,
                "context_max": context, "draft_tokens": rows * (query - 1), "accepted_tokens": 0,
                "draft_budget": -1, "forward_s": 1.0, "verify_s": host, "drafter_s": 0.0, "other_s": 0.0}
    units = {"baseline": [it_row(0, 4, 1, 16, 0.001), it_row(1, 4, 1, 64, 0.001), it_row(2, 4, 1, 64, 0.001)],
             "spec": [it_row(0, 4, 5, 16, 0.002), it_row(1, 1, 25, 64, 0.003)]}
    for method, its in units.items():
        writer.write_unit(0, method, [], {"wall_s": 1.0, "num_rollouts": 0, "output_tokens": 0,
                                          "forward_passes": len(its)}, iteration_rows=its)
    table = grid_table(lambda r, q, c: 1e-3 * r * q + 1e-5 * c)
    per = predict(tmp_path / "run", table=table).set_index("method")
    base = (1e-3 * 4 + 1e-5 * 16) + 2 * (1e-3 * 4 + 1e-5 * 64) + 3 * 0.001
    spec = (1e-3 * 20 + 1e-5 * 16) + (1e-3 * 25 + 1e-5 * 64) + 0.005
    assert per.loc["baseline", "predicted_s"] == pytest.approx(base)
    assert per.loc["spec", "predicted_s"] == pytest.approx(spec)
    assert per.loc["spec", "predicted_speedup"] == pytest.approx(base / spec)
    no_host = predict(tmp_path / "run", table=table, host="none").set_index("method")
    assert no_host.loc["spec", "predicted_s"] == pytest.approx(spec - 0.005)


def test_tree_blocks_are_priced_from_the_tree_grid_where_the_table_has_one():
    def rows_of(tree, factor):
        return [{"rows": r, "query": q, "context": c, "seconds": factor * 1e-4 * r * q, "tree": tree}
                for r in (1, 4, 16) for q in (1, 5, 25) for c in (16, 64)]
    table = LatencyTable(pd.DataFrame(rows_of(0, 1.0) + rows_of(1, 1.5)), "hand-made")
    shapes = ([4, 4, 16], [5, 5, 25], [16, 16, 64])
    assert table.seconds(*shapes) == pytest.approx([2e-3, 2e-3, 0.04], rel=1e-9)  # chains
    assert table.seconds(*shapes, tree=[False, True, True]) == pytest.approx([2e-3, 3e-3, 0.06], rel=1e-9)
    chain_only = grid_table(lambda r, q, c: 1e-4 * r * q)  # no tree grid: every pass at the chain price
    assert chain_only.seconds(*shapes, tree=[True, True, True]) == pytest.approx([2e-3, 2e-3, 0.04], rel=1e-9)
    from bench.spec.latency import pass_seconds
    it = pd.DataFrame({"rows": [4, 4], "block_tokens": [20, 20], "query_tokens": [20, 20], "context_sum": [64, 64],
                       "tree_block": [False, True]})
    assert pass_seconds(it, table)[0] == pytest.approx([2e-3, 3e-3], rel=1e-9)


def test_a_profile_with_trees_times_tree_blocks_beside_chains(tiny_trace):
    from bench.engines.torch.engine import TorchRefEngine
    from bench.engines.torch.timing import profile
    from bench.traces.format import Trace
    trace = Trace.load(tiny_trace)
    engine = TorchRefEngine(dtype="float32")
    engine.load(trace.checkpoint(trace.step_numbers[-1]))
    frame = profile(engine, rows=(1, 2), query=(1, 3), context=(8,), repeats=1, progress=False, trees=True)
    assert sorted(map(tuple, frame[["tree", "rows", "query"]].values.tolist())) == \
        [(t, r, q) for t in (0, 1) for r in (1, 2) for q in (1, 3)]
    table = LatencyTable(frame, "profiled")
    assert table.trees is not None and (frame["seconds"] > 0).all()


def test_roofline_by_hand_and_bundled_shapes():
    hw = Hardware("toy", memory_bandwidth_gbs=1.0, peak_tflops=1e-3, memory_gb=1.0,
                  bandwidth_efficiency=1.0, flops_efficiency=1.0)
    model = ModelShape("toy", hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2,
                       vocab=10, tied=True, dtype_bytes=2)
    weights = model.layer_params + 10 * 4  # layer matmuls + the LM head (the tied embedding is a gather)
    assert model.layer_params == 4 * 2 * 2 * 2 + 4 * 1 * 2 * 2 + 3 * 4 * 8
    kv = 1 * 2 * 1 * 2 * 2  # layers x (K, V) x kv heads x head dim x bytes
    t = roofline_seconds(hw, model, [1, 1000], [10, 10], [1, 1])
    mem = [(weights * 2 + 10 * kv) / 1e9] * 2
    flops = [(2 * weights * q + 4 * 1 * 2 * 2 * q * 10) / 1e9 for q in (1, 1000)]
    assert t == pytest.approx(np.maximum(mem, flops))
    # the bundled shapes are the published parameter counts (weights without biases)
    for name, billions in (("qwen2.5-0.5b", 0.494), ("qwen2.5-1.5b", 1.54), ("qwen2.5-7b", 7.62),
                           ("llama-3.1-8b", 8.03)):
        assert math.isclose(ModelShape.named(name).params / 1e9, billions, rel_tol=0.01)
    for name in ("h100_sxm", "h200", "a100", "l40s"):
        assert Hardware.named(name).memory_bandwidth_gbs > 500
    with pytest.raises(UserError, match="no hardware named"):
        Hardware.named("tpu9000")


def test_the_policys_table_covers_the_models_contexts():
    from bench.engines.torch.timing import AUTO_QUERY, auto_contexts
    widest = max(AUTO_QUERY)
    assert auto_contexts(32768) == (32, 256, 1024)
    assert auto_contexts(768) == (32, 256, 768 - widest - 1)  # the main job's policy: its longest rows fit
    assert auto_contexts(40) == (40 - widest - 1,)  # a model shorter than the grid: one context


def test_appended_shapes_widen_one_grid_and_a_foreign_table_is_refused(tmp_path):
    from bench.benchmarks.latency import appended
    meta = {"engine": "torch_ref", "hardware": "cpu x", "threads": 2, "model": "m", "dtype": "float32"}

    def rows_of(tree, queries):
        return [{"rows": r, "query": q, "context": c, "seconds": (1.5 if tree else 1.0) * 1e-4 * r * q,
                 "tree": tree, **meta} for r in (1, 4) for q in queries for c in (16, 64)]
    path = tmp_path / "t.csv"
    pd.DataFrame(rows_of(0, (1, 5)) + rows_of(1, (1, 5))).to_csv(path, index=False)
    wide = pd.DataFrame(rows_of(0, (5, 25))).drop(columns=["tree"])  # chains only, one shape timed again
    wide.loc[wide["query"] == 5, "seconds"] *= 2
    table = LatencyTable(appended(path, wide), "appended")
    assert list(table.axes[1]) == [1, 5, 25] and list(table.trees.axes[1]) == [1, 5]
    assert table.seconds([4], [25], [16]) == pytest.approx([1e-2], rel=1e-9)
    assert table.seconds([4], [5], [16]) == pytest.approx([4e-3], rel=1e-9)  # the newer timing replaces the old
    with pytest.raises(UserError, match="threads"):
        appended(path, wide.assign(threads=1))
    with pytest.raises(UserError, match="does not exist"):
        appended(tmp_path / "none.csv", wide)
