"""The speculation policies' pieces: counterfactual acceptance of capped drafts (chains and trees),
the cost model fitted to the iteration log, the fast table lookup and the policy's table from a
noisy profile. Token identity under every policy is tests/test_latency.py's."""
import math

import numpy as np
import pandas as pd
import pytest

from bench.engines.torch.timing import robust_seconds
from bench.spec.latency import LatencyTable
from bench.spec.policy import SpecPolicy
from bench.spec.policy_acceptance import AcceptanceTracker
from bench.spec.policy_costs import LinearFit
from bench.spec.policy_table import CONTEXT_STEP, TableLookup
from methods.base import Draft


def grid_table(fn, rows=(1, 4, 16, 64), query=(1, 5, 25), context=(16, 64)) -> LatencyTable:
    frame = pd.DataFrame([{"rows": r, "query": q, "context": c, "seconds": fn(r, q, c)}
                          for r in rows for q in query for c in context])
    return LatencyTable(frame, "hand-made")


def test_chain_rates_are_conditional_on_reaching_the_node():
    t = AcceptanceTracker(weight=0.0)  # no prior: the raw counts
    for accepted in (0, 1, 2, 3):  # four chains of 3 nodes, 0 .. 3 of them accepted
        t.record(3, accepted)
    # node 0 reached 4 times, hit 3; node 1 reached 3 times, hit 2; node 2 reached 2 times, hit 1
    assert t.reached == [4, 3, 2] and t.hit == [3, 2, 1]
    assert t.rates(3) == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    # P(node i accepted) multiplies along the chain: 3/4, 1/2, 1/4 = the share with more than i accepted
    assert t.chain_reach(3) == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert t.expected_tokens(3) == pytest.approx(1 + 1.5)


def test_tree_nodes_are_reached_through_their_parent():
    t = AcceptanceTracker(weight=0.0)
    # root children 0 and 1, node 2 under 0, node 3 under 1; the path took 1 then 3
    t.record(4, 2, path=[1, 3], parents=[-1, -1, 0, 1])
    assert t.reached == [1, 1, 0, 1] and t.hit == [0, 1, 0, 1]
    # the expected accepted tokens of a tree multiply the rates along each node's ancestors
    t2 = AcceptanceTracker(reached=[2, 2, 2], hit=[1, 1, 1], weight=0.0)
    assert t2.expected_tokens(3, parents=[-1, -1, 0]) == pytest.approx(1 + 0.5 + 0.5 + 0.25)


def test_unexplored_nodes_get_the_pooled_rate_and_proposal_lengths_weigh_them():
    t = AcceptanceTracker()
    assert t.rates(2) == pytest.approx([0.5, 0.5])  # no evidence: 1/2
    for _ in range(20):
        t.record(2, 2)  # every node accepted
    pooled = (40 + 1) / (40 + 2)
    assert t.rate(5) == pytest.approx(pooled)  # never reached: the pooled rate
    t.record_proposals([0, 0, 0, 4])  # one proposal in 4 has any draft
    assert t.longer_than(0) == pytest.approx(2 / 5) and t.longer_than(4) == pytest.approx(1 / 5)
    reach = t.chain_reach(2)
    assert t.expected_row_tokens(2) == pytest.approx(1 + 2 / 5 * reach[0] + 2 / 5 * reach[1])


def test_linear_fit():
    f = LinearFit()
    assert f(10) == 0.0  # no evidence: costs nothing
    f.add(4, 0.4)
    assert f(8) == pytest.approx(0.8)  # one row count: proportional
    for r in (1, 2, 3, 5, 8):
        f.add(r, 0.5 + 0.1 * r)
    g = LinearFit()
    for r in (1, 2, 3, 5, 8, 13):
        g.add(r, 0.5 + 0.1 * r)
    assert g(20) == pytest.approx(2.5) and g(0) == pytest.approx(0.5)


def test_query_seconds_equals_the_table_lookup():
    table = grid_table(lambda r, q, c: 1e-4 * (1 + r * q) * (1 + c / 64))
    rng = np.random.default_rng(0)
    for _ in range(50):
        r, c = float(rng.uniform(1, 200)), float(rng.uniform(1, 300))
        qs = [1, 2, 3, 7, 13, 25, 40, 65]
        assert table.query_seconds(r, qs, c) == pytest.approx(list(table.seconds([r] * 8, qs, [c] * 8)), rel=1e-9)


def test_table_lookup_reads_the_table_at_the_rounded_context_whatever_filled_its_memo():
    table = grid_table(lambda r, q, c: 1e-4 * (1 + r * q) * (1 + c / 64))
    lookup = TableLookup(table)
    for r, c in ((3, 100.0), (3, 100.4), (64, 517.0), (1, 0.2)):
        rounded = math.exp(round(math.log(max(c, 1.0)) / CONTEXT_STEP) * CONTEXT_STEP)
        want = table.query_seconds(r, [1, 4, 9], rounded)
        assert lookup(r, [1, 4, 9], c) == pytest.approx(want, rel=1e-12)
        assert lookup(r, [9, 4], c) == pytest.approx(want[:0:-1], rel=1e-12)  # from the memo, in the asked order
        assert lookup.one(r, 4, c) == pytest.approx(want[1], rel=1e-12)
        assert lookup(r, [4], c)[0] == pytest.approx(table.query_seconds(r, [4], c)[0], rel=0.01)  # within 1%
    assert len(lookup._memo) == 3 * 3  # (3, 100.0) and (3, 100.4) share their entries
    lookup(3, [1], math.exp((round(math.log(100.0) / CONTEXT_STEP) + 1) * CONTEXT_STEP))  # the next step: new
    assert len(lookup._memo) == 3 * 3 + 1
    # contexts a hair apart (100.0, 100.4) share one entry: the second read the first's seconds
    assert lookup(3, [1], 100.0) == lookup(3, [1], 100.4)


def test_robust_seconds_takes_the_fastest_repeat_and_is_monotone():
    rows = []
    for r in (1, 4):
        for q in (1, 5):
            fast = 1e-3 * r * q
            slow = fast * (5 if (r, q) == (1, 1) else 1.2)  # a burst of load at the smallest shape
            rows.append({"rows": r, "query": q, "context": 32, "seconds": slow, "seconds_min": fast * (
                7 if (r, q) == (1, 1) else 1)})
    out = robust_seconds(pd.DataFrame(rows)).set_index(["rows", "query"])["seconds"]
    assert out[(1, 5)] == pytest.approx(5e-3) and out[(4, 5)] == pytest.approx(20e-3)
    assert out[(1, 1)] == pytest.approx(4e-3)  # 7 ms at (1, 1) > 4 ms at (4, 1): capped


def test_throughput_optimal_drafts_where_it_pays_and_not_where_drafting_costs_more():
    # a pass costs 1 ms plus 10 us per token: with few rows verifying more is almost free
    table = grid_table(lambda r, q, c: 1e-3 + 1e-5 * r * q)
    policy = SpecPolicy("throughput_optimal", table=table)
    policy.start_call("Chains")
    for _ in range(200):
        policy.record(8, 4)  # half of an 8-token chain accepted, evenly
    assert policy.budget(1, 32.0) > 0
    # a drafter whose proposals cost 1 ms per row never pays at 64 rows: it is not even asked
    for rows in (64, 60, 56):
        policy.record_iteration([(rows, 1, rows, table.seconds([rows], [1], [32])[0], "plain")], 32.0, 0.0, 1e-3 * rows, 0.0)
    assert policy.budget(64, 32.0) == 0
    # the fits carry over to the next call of the same drafter, not to another one
    policy.start_call("Other")
    assert policy.costs.drafter(64) == 0.0
    policy.start_call("Chains")
    assert policy.costs.drafter(64) == pytest.approx(64e-3)


def test_choose_caps_at_the_real_drafts():
    table = grid_table(lambda r, q, c: 1e-3 * q)  # k tokens cost k passes
    policy = SpecPolicy("throughput_optimal", table=table)
    policy.start_call("X")
    for _ in range(100):
        policy.record(4, 4)  # every node accepted so far
    # drafts shorter than any budget: the cap is their longest length at most
    assert policy.choose([Draft([1, 2]), Draft([3])], 32.0, 64) <= 2
    assert policy.choose([Draft(), Draft()], 32.0, 64) == 0
    for _ in range(400):
        policy.record(4, 0)  # now nothing is accepted: verifying drafts only costs
    assert policy.choose([Draft([1, 2, 3])], 32.0, 64) == 0


def test_run_ahead_rows_only_into_idle_capacity():
    flat = grid_table(lambda r, q, c: 1e-3)  # an extra row costs nothing: every free slot
    steep = grid_table(lambda r, q, c: 1e-3 * r)  # every row costs its share: none
    assert SpecPolicy("throughput_optimal", table=flat).run_ahead_rows(4, 10, 32.0) == 10
    assert SpecPolicy("throughput_optimal", table=steep).run_ahead_rows(4, 10, 32.0) == 0
    assert SpecPolicy("fixed").run_ahead_rows(4, 10, 32.0) == 10
    some = grid_table(lambda r, q, c: 1e-3 + 1e-6 * r)  # +0.1% a row at 1 ms: 5% is about 50 rows
    n = SpecPolicy("throughput_optimal", table=some).run_ahead_rows(4, 64, 32.0)
    assert 30 <= n <= 60


def test_run_ahead_slack_does_not_compound():
    some = grid_table(lambda r, q, c: 1e-3 + 1e-5 * r)  # +1% a row at 1 ms
    policy = SpecPolicy("throughput_optimal", table=some)
    first = policy.run_ahead_rows(4, 64, 32.0, trained_rows=4)
    assert 1 <= first <= 8
    # with those run-ahead rows in flight, no more: the slack is measured against the trained rows
    assert policy.run_ahead_rows(4 + first, 64, 32.0, trained_rows=4) == 0


def test_a_verdict_against_drafting_is_probed_again_where_probing_is_cheap():
    # one live row, a pass costs 1 ms plus 10 us per token: verifying 8 more tokens is almost free
    table = grid_table(lambda r, q, c: 1e-3 + 1e-5 * r * q)
    policy = SpecPolicy("throughput_optimal", table=table)
    policy.start_call("FirstDraftsWrong")
    policy.record_iteration([(1, 1, 1, 1.01e-3, "plain")], 32.0, 0.0, 1e-4, 0.0)  # proposals cost 0.1 ms
    for _ in range(64):
        policy.record(1, 0)  # every row's draft at output length 1 rejected
    decided = [policy.budget(1, 32.0) for _ in range(16)]
    assert decided == [0] * 16  # drafting does not pay on that evidence: not even asked
    probe = policy.budget(1, 32.0)  # the 17th idle iteration: a probe, cheap at one row
    assert probe == 8
    assert policy.choose([Draft(list(range(20)))], 32.0, probe) == 8  # the probe is verified as asked
    for _ in range(3):  # the drafts are good now; each drafted iteration weighs the old verdict down
        policy.record(8, 8)
        policy.choose([Draft(list(range(20)))], 32.0, 8)
    policy.record(8, 8)
    assert policy.tracker.rate(0) > 0.5
    assert policy.budget(2, 32.0) > 0  # a new decision drafts again


def test_no_probe_where_a_probe_costs_its_tokens():
    table = grid_table(lambda r, q, c: 1e-3 * r * q)  # every token costs a pass (this CPU at full batch)
    policy = SpecPolicy("throughput_optimal", table=table)
    policy.start_call("X")
    for _ in range(64):
        policy.record(1, 0)
    assert all(policy.budget(64, 32.0) == 0 for _ in range(100))


def test_first_drafts_do_not_count_as_proposal_lengths():
    table = grid_table(lambda r, q, c: 1e-3)
    policy = SpecPolicy("throughput_optimal", table=table)
    policy.start_call("X")
    policy.choose_first([Draft(), Draft([1, 2])], 2, 10, 32.0, 4)  # first drafts: decided on their own
    assert policy.tracker.asked == 0
    policy.choose([Draft([1])], 32.0, 4)
    assert policy.tracker.asked == 1 and policy.tracker.longer_than(0) == pytest.approx(2 / 2)


def test_drafted_passes_and_their_host_seconds_are_scaled_on_their_own():
    # every extra query token costs 0.9 of a row's plain pass: with every node accepted, verifying
    # 64 more tokens gives 65 tokens for 58.6 passes' seconds, about 11% more tokens per second
    table = grid_table(lambda r, q, c: 1e-3 * r * (1 + 0.9 * (q - 1)), query=(1, 2, 5, 9, 17, 33, 65))
    policy = SpecPolicy("throughput_optimal", table=table)
    policy.start_call("Chains")
    for _ in range(200):
        policy.record(64, 64)
    policy.record_iteration([(4, 1, 4, table.seconds([4], [1], [32])[0], "plain")], 32.0, 0.0, None, 0.0)
    # a prefill (prompt tokens in the block) at 5x the table is not evidence of decoding's speed
    policy.record_iteration([(4, 11, 44, 5 * table.seconds([4], [9], [32])[0], "prefill")], 32.0, 0.0, None, 1.0)
    assert policy.costs.scale == pytest.approx(1.0) and policy.costs.host.n == 1
    assert policy.budget(4, 32.0) > 0  # plain passes on the table and no drafted pass seen yet: it pays
    # drafted passes measured at 1.5x the table while plain ones stay on it: drafting loses 25%
    for _ in range(20):
        policy.record_iteration([(4, 9, 36, 1.5 * table.seconds([4], [9], [32])[0], "drafted")], 32.0, 0.0, 0.0, 0.0)
    assert policy.costs.scale == pytest.approx(1.0)
    assert policy.costs.spec_scale == pytest.approx((20 * 1.5 + 4 * 1.0) / 24)
    assert policy.budget(5, 32.0) == 0
    # the next call of the same drafter starts from that ratio, another drafter's from 1
    policy.start_call("Chains")
    assert policy.costs.spec_prior == pytest.approx((20 * 1.5 + 4) / 24)
    policy.start_call("Other")
    assert policy.costs.spec_scale == 1.0


def test_host_seconds_of_iterations_that_verify_drafts_count_against_drafting():
    table = grid_table(lambda r, q, c: 1e-3 + 1e-5 * r * q)  # verifying more is almost free ...
    policy = SpecPolicy("throughput_optimal", table=table)
    policy.start_call("Chains")
    for _ in range(200):
        policy.record(8, 4)
    plain = table.seconds([16], [1], [32])[0]
    assert policy.budget(16, 32.0) == 4  # 4 of 8 accepted: 5 tokens a row for 1.55x a plain pass
    for rows in (16, 15, 14):  # ... but an iteration that verified drafts spent 10 ms more on the host
        policy.record_iteration([(rows, 1, rows, plain, "plain")], 32.0, 0.0, None, 0.0)
        policy.record_iteration([(rows, 9, 9 * rows, table.seconds([rows], [9], [32])[0], "drafted")], 32.0,
                                0.0, 0.0, 10e-3)
    assert policy.costs.host(16) == 0.0 and policy.costs.host_for(16, True) == pytest.approx(10e-3, rel=0.01)
    assert policy.budget(13, 32.0) == 0


def test_plain_pass_scale_starts_from_the_last_logged_call():
    table = grid_table(lambda r, q, c: 1e-3 * r)
    policy = SpecPolicy("throughput_optimal", table=table)
    t = table.seconds([4], [1], [32])[0]
    # a finished call's log (any method's, the baseline's too): a prefill, then plain passes at half the table
    log = [{"iteration": 0, "rows": 4, "block_tokens": 44, "draft_tokens": 0, "context_sum": 0, "forward_s": 1.0}]
    log += [{"iteration": i, "rows": 4, "block_tokens": 4, "draft_tokens": 0, "context_sum": 128,
             "forward_s": 0.5 * t} for i in range(1, 11)]
    log.append({"iteration": 11, "rows": 4, "block_tokens": 20, "draft_tokens": 16, "context_sum": 128,
                "forward_s": 9.0})  # a drafted pass: not plain
    policy.learn_plain_speed(log)
    policy.start_call("B")
    assert policy.costs.scale == pytest.approx(0.5)
    # two cold first passes at 1.6x the table move it only part of the way
    for _ in range(2):
        policy.record_iteration([(4, 1, 4, 1.6 * t, "plain")], 32.0, 0.0, None, 0.0)
    assert policy.costs.scale == pytest.approx((2 * 1.6 + 8 * 0.5) / 10)
    policy.learn_plain_speed(log[:5])  # too few plain passes to say: the prior stays
    policy.start_call("C")
    assert policy.costs.scale == pytest.approx(0.5)


def test_first_drafts_are_weighed_on_their_own_acceptance_carried_between_calls():
    # a prefill of 8 rows x 10 prompt tokens; every extra token of the block costs 1% of it
    table = grid_table(lambda r, q, c: 1e-3 * r * (10 + 0.1 * q), query=(1, 5, 25, 125, 625))
    policy = SpecPolicy("throughput_optimal", table=table)
    policy.start_call("Reuse")
    long = [Draft(list(range(100))) for _ in range(8)]
    first = policy.choose_first(long, 8, 10, 10.0, None)
    assert 0 < first < 100  # no evidence yet (1/2 a node): a short first draft, not the whole one
    for _ in range(8):
        policy.record(first, first, first=True)  # ... all accepted
    policy.record(4, 0)  # a decoding draft rejected: no bearing on first drafts
    assert policy.first.rate(0) > 0.9 and policy.tracker.rate(0) < 0.5
    policy.start_call("Reuse")  # the next step: longer first drafts are worth verifying
    second = policy.choose_first(long, 8, 10, 10.0, None)
    assert second > first
    for _ in range(8):
        policy.record(second, second, first=True)
    policy.start_call("Reuse")
    assert policy.choose_first(long, 8, 10, 10.0, None) == 100  # and then the whole previous rollout
    policy.start_call("Other")  # another drafter starts from nothing
    assert policy.choose_first(long, 8, 10, 10.0, None) < 100
    # other policies leave first drafts to budget's cap
    assert SpecPolicy("fixed").choose_first(long, 8, 10, 10.0, None) is None
    assert SpecPolicy("batch_threshold").choose_first(long, 8, 10, 10.0, 0) == 0
