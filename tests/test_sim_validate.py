"""bench.harness.sim_validate: a run's measured speedups beside the simulator's priced schedule of its steps."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bench.harness.sim_validate import (HostModel, drafter_level, host_model, main, summary, table_level, validate,
                                        verifier_costs)

ROOT = Path(__file__).resolve().parent.parent


def test_host_model_is_fitted_on_the_baseline_alone():
    rows = [{"method": "baseline", "step": 0, "iteration": i, "call": 0, "rows": r, "live_rows": r,
             "verify_s": 2e-4 + 1e-4 * r, "other_s": 1e-3 + 1e-5 * r} for i, r in enumerate([8, 8, 6, 4, 2, 1])]
    rows += [{"method": "tree_cache", "step": 0, "iteration": i, "call": 0, "rows": 8, "live_rows": 8, "verify_s": 1.0,
              "other_s": 1.0} for i in range(4)]  # a method's seconds never enter the fit
    host = host_model(pd.DataFrame(rows))
    assert (host.verify_a, host.verify_b, host.other_a, host.other_b) == pytest.approx((2e-4, 1e-4, 1e-3, 1e-5), rel=1e-6)


def test_a_hand_made_schedule_gets_its_hand_computed_host_seconds():
    host = HostModel(verify_a=1e-3, verify_b=1e-4, other_a=2e-3, other_b=1e-5, per_node=1e-6, per_accepted=1e-7)
    it = pd.DataFrame({"call": [0, 1, 0], "rows": [4, 2, 3], "live_rows": [6, 6, 3], "nodes_read": [4, 22, 33],
                       "accepted_tokens": [0, 5, 9]})
    # pass 1: a plain pass and its iteration's rest; pass 2: the second group, 20 further nodes read;
    # pass 3: 30 further nodes and 9 accepted tokens
    expected = [1e-3 + 4e-4 + 2e-3 + 6e-5, 1e-3 + 2e-4 + 20e-6 + 5e-7, 1e-3 + 3e-4 + 30e-6 + 9e-7 + 2e-3 + 3e-5]
    assert host.seconds(it) == pytest.approx(expected, rel=1e-12)


def test_the_drafters_level_is_the_baselines_run_over_simulated_seconds():
    run = pd.DataFrame({"method": ["baseline", "baseline", "baseline", "das"], "step": [1, 1, 2, 1],
                        "drafter_s": [2e-3, 1e-3, 5e-3, 9.0]})
    sim = pd.DataFrame({"method": ["baseline", "baseline", "das"], "step": [1, 2, 1], "drafter_s": [1e-3, 5e-3, 1.0]})
    assert drafter_level(run, sim) == pytest.approx({1: 3.0, 2: 1.0})  # the methods' seconds never enter it


def test_the_tables_level_is_the_baselines_measured_over_profiled_seconds():
    from bench.spec.latency import LatencyTable
    frame = pd.DataFrame([{"rows": r, "query": q, "context": c, "seconds": 1e-4 * r * q, "tree": t}
                          for r in (1, 4) for q in (1, 5) for c in (16, 64) for t in (0, 1)])
    table = LatencyTable(frame, "hand-made")
    shape = {"rows": [4, 1], "block_tokens": [4, 5], "query_tokens": [4, 5], "context_sum": [64, 16],
             "tree_block": [False, True]}  # priced 4e-4 and 5e-4
    it = pd.DataFrame({**shape, "method": ["baseline"] * 2, "forward_s": [8e-4, 1e-3]})
    it = pd.concat([it, it.assign(method="tree_cache", forward_s=1.0)])  # a method's seconds never enter it
    assert table_level(it, table) == pytest.approx(2.0, rel=1e-9)
    doubled = table.scaled(2.0)
    assert doubled.seconds([4, 1], [1, 5], [64, 16], tree=[False, True]) == pytest.approx([8e-4, 1e-3], rel=1e-9)
    with pytest.raises(Exception, match="positive factor"):
        table.scaled(0.0)


def test_the_verifier_costs_something_per_node_read():
    from bench.core.sampling import SamplingConfig
    per_node, per_accepted = verifier_costs(145, SamplingConfig(temperature=1.0), repeats=5)
    assert 0 < per_node < 1e-3 and 0 <= per_accepted < 1e-3


@pytest.mark.slow
def test_a_replay_and_its_simulation_priced(tmp_path):
    from test_scheduler import gpu_like_table
    done = subprocess.run([sys.executable, "-m", "bench.harness.cli", "trace=countdown_tiny", "method=[baseline,tree_cache]",
                           "max_steps=2", "plots=false", "progress=false", "predict=[]", "run_id=val",
                           f"results_root={tmp_path / 'runs'}"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    gpu_like_table(tmp_path / "table.csv")
    per = validate(tmp_path / "runs" / "val", tmp_path / "table.csv")
    assert sorted(set(per["method"])) == ["baseline", "tree_cache"] and len(per) == 4
    base = per[per["method"] == "baseline"]
    assert (base["measured_speedup"] == 1).all() and (base["predicted_speedup"] == 1).all()
    assert per["error"].notna().all() and (per["predicted_s"] > 0).all()
    assert list(summary(per)["method"]) == ["baseline", "tree_cache"]
    with pytest.raises(SystemExit, match="median error up to"):  # tolerance 0: some error is always there
        main([str(tmp_path / "runs" / "val"), "--table", str(tmp_path / "table.csv"), "--tolerance", "0"])


def test_each_method_is_simulated_over_the_tokens_it_emitted():
    from bench.core.errors import UserError
    from bench.harness.sim_validate import run_tokens
    trace = {s: pd.DataFrame({"prompt_id": ["a", "a", "b"], "sample_idx": [0, 1, 0],
                              "token_ids": [[1, 2], [1, 3], [4]], "logprobs": [[0.0, 0.0], [0.0, 0.0], [0.0]],
                              "reward": [1.0, 0.0, 1.0], "finish_reason": ["stop"] * 3}) for s in (0, 1)}
    run = pd.DataFrame({"step": [1] * 4, "method": ["m", "m", "m", "m"], "run_ahead": [False, False, False, True],
                        "prompt_id": ["b", "a", "a", "a"], "sample_idx": [0, 1, 0, 2],  # another order
                        "output_tokens": [[4], [1, 3, 9, 9], [1, 2], [7]], "logprobs": [[0.0], [-1.0] * 4, [0.0] * 2, [0.0]],
                        "finish_reason": ["stop", "length", "stop", "stop"]})
    out = run_tokens(trace, run, "m")
    assert out[0] is trace[0]  # a step the run did not run: the trace's, as the replay fed it
    assert out[1]["token_ids"].tolist() == [[1, 2], [1, 3, 9, 9], [4]]  # the trace's row order, the run's tokens
    assert out[1]["finish_reason"].tolist() == ["stop", "length", "stop"]
    assert trace[1]["token_ids"].tolist()[1] == [1, 3]  # the trace itself untouched
    with pytest.raises(UserError, match="no m rollout"):
        run_tokens(trace, run[run["prompt_id"] != "b"], "m")
    with pytest.raises(UserError, match="tokens='mine'"):
        validate(Path("."), Path("t.csv"), tokens="mine")
