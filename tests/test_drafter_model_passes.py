"""A learned drafter's own forward passes priced on the target accelerator (bench/drafters/model_passes.py):
counted per pass in bytes and FLOPs, logged per iteration by the scheduler, and priced by the
roofline in place of the seconds this machine measured (``bench.spec.latency.predict_iterations``)."""
from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest

from bench.drafters.model_passes import FIELDS, ModelPasses
from bench.spec.latency import LatencyTable, predict_iterations
from bench.spec.roofline import Hardware, ModelShape, pass_bytes_flops

TOY = ModelShape("toy", hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=10, tied=True)
# 1 GB/s, 1 TFLOP/s, no efficiency losses, 10 us a pass: every price below is read off by hand
HW = Hardware("toy", memory_bandwidth_gbs=1.0, peak_tflops=1.0, memory_gb=1.0, bandwidth_efficiency=1.0,
              flops_efficiency=1.0, overhead_s=1e-5)


def test_passes_are_counted_by_class_and_taken_once():
    passes = ModelPasses(TOY, extra_weights=32)
    passes.add(3, 19, 19)  # the windows: 19 tokens over 3 rows
    for j in (1, 2):
        passes.add(3, 3, 19 + 3 * j)  # one token a row
    got = passes.take()
    wb, wf = pass_bytes_flops(TOY, 19, 19, 3, 32)
    sb = [pass_bytes_flops(TOY, 3, 19 + 3 * j, 3, 32) for j in (1, 2)]
    assert got["drafter_model_passes"] == 3
    assert got["drafter_window_bytes"] == pytest.approx(wb) and got["drafter_window_flops"] == pytest.approx(wf)
    assert got["drafter_step_bytes"] == pytest.approx(sb[0][0] + sb[1][0])
    assert got["drafter_step_flops"] == pytest.approx(sb[0][1] + sb[1][1])
    assert (TOY.layer_params + 10 * 4 + 32) * 2 + 19 * TOY.kv_bytes_per_token() == pytest.approx(wb)
    assert passes.take() == dict.fromkeys(FIELDS, 0)


def _log() -> pd.DataFrame:
    """One step, one iteration each: the baseline, and a learned drafter whose 6 passes this CPU
    timed at 50 ms of its 60 ms drafting."""
    base = dict(step=0, iteration=0, call=0, rows=2, live_rows=2, query_tokens=2, block_tokens=2, context_sum=20,
                tree_block=False, forward_s=0.1, verify_s=0.001, other_s=0.002)
    rows = [dict(base, method="baseline", drafter_s=0.0),
            dict(base, method="draft_lm", query_tokens=8, block_tokens=8, drafter_s=0.06, drafter_model_s=0.05,
                 drafter_model_passes=6, drafter_window_bytes=2e3, drafter_window_flops=4e9,  # 4 ms of FLOPs
                 drafter_step_bytes=3e6, drafter_step_flops=1e6)]  # 3 ms of bytes
    return pd.DataFrame(rows)


def test_the_roofline_prices_a_learned_drafters_passes_and_takes_them_out_of_the_host_seconds():
    per = predict_iterations(_log(), hardware=HW, model=TOY).set_index("method")
    priced = 4e-3 + 3e-3 + 6 * 1e-5  # each class at its bound, plus the per-pass overhead
    without = predict_iterations(_log().assign(drafter_model_passes=0), hardware=HW, model=TOY).set_index("method")
    assert per.loc["draft_lm", "predicted_forward_s"] == pytest.approx(
        without.loc["draft_lm", "predicted_forward_s"] + priced)
    assert per.loc["baseline", "predicted_forward_s"] == without.loc["baseline", "predicted_forward_s"]
    assert per.loc["draft_lm", "predicted_host_s"] == pytest.approx(0.06 - 0.05 + 0.001 + 0.002)
    assert per.loc["baseline", "predicted_host_s"] == pytest.approx(0.003)
    only = predict_iterations(_log(), hardware=HW, model=TOY, host="none").set_index("method")
    assert only.loc["draft_lm", "predicted_s"] == pytest.approx(per.loc["draft_lm", "predicted_forward_s"])


def test_a_measured_table_keeps_the_drafters_measured_seconds():
    table = LatencyTable(pd.DataFrame([{"rows": r, "query": q, "context": c, "seconds": 0.01 * r * q}
                                       for r in (1, 4) for q in (1, 8) for c in (5, 20)]), "toy")
    per = predict_iterations(_log(), table=table).set_index("method")
    assert per.loc["draft_lm", "predicted_host_s"] == pytest.approx(0.06 + 0.001 + 0.002)


def test_the_scheduler_logs_a_draft_lms_passes_on_each_iterations_first_pass():
    from bench.harness.sim_replay import run_step
    from bench.spec.recorded import feed_finished
    from tests.test_learned_drafter import PROMPTS, _responses, _small
    rng = random.Random(0)
    d = _small()
    for step in range(3):
        feed_finished(d, step, _responses(step, rng), PROMPTS)
    log: list[dict] = []
    run_step(d, 3, _responses(3, rng), PROMPTS, 64, iteration_log=log)
    it = pd.DataFrame(log)
    first = it[it["call"] == 0]
    drafted = first[first["drafter_model_passes"] > 0]
    assert len(drafted) and (it.loc[it["call"] > 0, "drafter_model_passes"] == 0).all()
    assert (drafted["drafter_model_passes"] % d.max_spec_tokens == 0).all()  # a 6-token chain: 6 passes
    assert (drafted["drafter_model_s"] > 0).all() and (drafted["drafter_model_s"] <= drafted["drafter_s"]).all()
    assert (drafted["drafter_window_flops"] > 0).all() and (drafted["drafter_step_bytes"] > 0).all()
    h100, shape = Hardware.named("h100_sxm"), ModelShape.named("qwen2.5-0.5b")
    per = predict_iterations(it.assign(step=3, method="draft_lm"), hardware=h100, model=shape)
    plain = predict_iterations(it.assign(step=3, method="draft_lm").drop(columns=list(FIELDS)),
                               hardware=h100, model=shape)
    # on an H100 the draft model's passes cost less than this CPU measured them
    assert np.all(per["predicted_s"] < plain["predicted_s"])
