"""The ratio rule's bias: exact per-position formula, Monte-Carlo agreement, and the engine on the tiny trace."""
from __future__ import annotations

import math

import pytest
import torch

from bench.benchmarks.bias import (audit_slots, monte_carlo_tv, replay_prefix_reuse, rule_distribution,
                        summarize_bias, tv_distance)
from bench.core.verify import VerifyConfig

Q = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)  # draft (old policy)
P = torch.tensor([0.2, 0.2, 0.4, 0.2], dtype=torch.float64)  # target (new policy)


def tv_rule(q, p, lenience):
    return float(tv_distance(rule_distribution(q, p, lenience), p))


def test_worked_example_of_the_docstring():
    r = rule_distribution(torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1]), 1.0)
    assert r.tolist() == pytest.approx([0.86, 0.14])
    assert float(tv_distance(r, torch.tensor([0.9, 0.1]))) == pytest.approx(0.04)


def test_biased_when_q_differs_from_p_even_at_lenience_one():
    # no residual resampling: at l = 1 the rule still keeps too much of q's mass
    assert tv_rule(Q, P, 1.0) > 0.01
    assert tv_rule(Q, P, math.exp(0.5)) > 0.01
    r = rule_distribution(Q, P, math.exp(0.5))
    assert float(r.sum()) == pytest.approx(1.0)


def test_unbiased_when_q_equals_p_at_lenience_one():
    # min(q, p) = p and nothing is rejected: r = p
    assert tv_rule(P, P, 1.0) == pytest.approx(0.0, abs=1e-12)
    # lenience cannot add bias either when q = p (min(q, l p) = q = p)
    assert tv_rule(P, P, 3.0) == pytest.approx(0.0, abs=1e-12)


def test_tv_grows_with_lenience_towards_tv_of_q_and_p():
    tvs = [tv_rule(Q, P, lenience) for lenience in (1.0, 1.2, math.exp(0.5), 2.0, 4.0, 1e6)]
    assert all(b >= a - 1e-15 for a, b in zip(tvs, tvs[1:])) and tvs[-1] > tvs[0]
    # l -> infinity accepts every draft: r = q
    assert tvs[-1] == pytest.approx(float(tv_distance(Q, P)))


@pytest.mark.parametrize("lenience", [1.0, math.exp(0.5)])
def test_exact_matches_monte_carlo(lenience):
    exact = tv_rule(Q, P, lenience)
    mc, noise = monte_carlo_tv(Q, P, lenience, samples=200_000, seed=1)
    # |mc - exact| <= TV(histogram, r), whose expected size is `noise`
    assert abs(mc - exact) < 4 * noise
    assert noise < 0.01


def test_monte_carlo_with_separate_ratio_distributions():
    # top-p truncation: the sampled q, p differ from the temperature-only q~, p~ the test reads
    q_r, p_r = Q, P
    q = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64) / 1.0
    p = torch.tensor([0.25, 0.25, 0.5, 0.0], dtype=torch.float64)
    exact = float(tv_distance(rule_distribution(q, p, 1.3, q_r, p_r), p))
    mc, noise = monte_carlo_tv(q, p, 1.3, samples=200_000, seed=2, q_ratio=q_r, p_ratio=p_r)
    assert abs(mc - exact) < 4 * noise


@pytest.mark.slow
def test_tiny_trace_audit_and_end_to_end_replay(tiny_trace):
    from bench.traces.format import Trace
    trace = Trace.load(tiny_trace)
    steps = trace.step_numbers[2:]  # every prompt of these steps was visited before
    slots = audit_slots(trace, math.exp(0.5), steps)
    table = summarize_bias(slots).set_index("step")
    assert len(slots) > 0 and 0 < table.loc["all", "bias_tv_per_token"] < 1
    assert (slots["reach"] >= 1).all() and (slots["reach"] <= slots["positions"]).all()
    # the lenient rule changes the rollouts; the same cache under the exact rule does not
    ratio = replay_prefix_reuse(trace, steps, VerifyConfig("ratio", math.exp(0.5)))
    exact = replay_prefix_reuse(trace, steps, VerifyConfig("exact"))
    for df, identical in ((ratio, False), (exact, True)):
        pr = df[df.method == "prefix_reuse"].reset_index(drop=True)
        base = df[df.method == "baseline"].reset_index(drop=True)
        assert pr[["step", "prompt_id", "sample_idx"]].equals(base[["step", "prompt_id", "sample_idx"]])
        assert (pr.token_ids.tolist() == base.token_ids.tolist()) is identical
    assert ratio[ratio.method == "prefix_reuse"]["accepted"].sum() > 0
