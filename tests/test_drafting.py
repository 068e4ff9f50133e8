"""bench.core.drafting: the one stop/room cut and counter implementation every engine uses, the drafter
modes that pick an engine configuration, and the rule on draft-only / top-1 scoring.

    python -m pytest tests/test_drafting.py -q
"""
import math
import random

import pytest
import torch

from bench.core.drafting import (DraftCounters, cut_emitted, drafter_mode, scoring_logprobs, settle,
                            verify_from_logprobs)
from bench.engines.vllm import proposer as vp
from bench.core.sampling import SamplingConfig
from bench.core.verify import VerifyConfig, verify_batch
from methods.base import Draft, NullDrafter, RolloutKey
from methods.baseline import Baseline
from methods.hybrid import HybridDrafter
from methods.prefix_reuse import PrefixReuseDrafter
from methods.tree_cache import TreeCacheDrafter


def test_cut_keeps_through_the_first_stop_and_within_the_room():
    assert cut_emitted([4, 2, 9], {2}, 8) == 2
    assert cut_emitted([4, 2, 9], {2}, 1) == 1
    assert cut_emitted([4, 5, 9], set(), 2) == 2
    assert cut_emitted([4, 5], (), 0) == 0


def test_settle_counts_the_accepted_tokens_that_survive_the_cut():
    c = DraftCounters()
    kept = settle(c, 3, [5, 6, 2, 7], 3, {2}, 0, 16)  # the stop token was an accepted draft token
    assert (kept.n, kept.accepted, kept.finish_reason) == (3, 3, "stop")
    kept = settle(c, 4, [1, 1, 1, 1, 1], 4, set(), 3, 5)  # 2 tokens of room left
    assert (kept.n, kept.accepted, kept.finish_reason) == (2, 2, "length")
    kept = settle(c, 0, [8], 0, set(), 0, 16)
    assert (kept.n, kept.accepted, kept.finish_reason) == (1, 0, "")
    assert c.as_dict() == {"num_forward_passes": 3, "num_drafts": 2, "num_draft_tokens": 7,
                           "num_accepted_tokens": 5, "num_accepted_tokens_per_pos": [2, 2, 1]}


def test_counters_add_and_label_scoring_passes_outside_the_rollout_fields():
    a, b = DraftCounters(), DraftCounters()
    a.record_scoring(12)
    a.record(4, 2)
    b.record(3, 3)
    b.record_plain(5)
    a.add(b)
    assert (a.num_forward_passes, a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (7, 2, 7, 5)
    assert a.num_accepted_tokens_per_pos == [2, 2, 1]
    assert (a.num_scoring_passes, a.num_scoring_tokens) == (1, 12)
    assert "num_scoring_passes" not in a.as_dict()  # Rollout(**as_dict()) keeps working


def test_drafter_modes_pick_the_engine_configuration():
    assert drafter_mode(Baseline()) == drafter_mode(NullDrafter()) == "baseline"
    assert drafter_mode(PrefixReuseDrafter()) == "prefix"
    assert drafter_mode(TreeCacheDrafter()) == drafter_mode(HybridDrafter()) == "tree"


def test_scoring_asks_the_full_distribution_only_where_the_rule_needs_it():
    assert scoring_logprobs(True, "exact", 0.0) == "top1"
    assert scoring_logprobs(False, "ratio", 1.0) == "draft"
    assert scoring_logprobs(False, "exact", 1.0) == "full"  # the coupled inverse CDF needs all of p
    assert scoring_logprobs(False, "ratio", 0.7) == "full"  # p(x) at T needs the normaliser of logits / T


def test_draft_only_ratio_decides_as_the_verifier():
    """With the draft tokens' logprobs and the engine's sample after the draft, the ratio rule accepts
    exactly what bench.core.verify accepts from the full logits (same coupled acceptance uniforms); a
    rejection leaves the rejected position to the engine's sampler."""
    g = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=64)
    rng = random.Random(0)
    seen = {"rejected": 0, "full": 0}
    for trial in range(200):
        k, V = rng.randint(1, 6), 12
        logits = torch.randn(1, k + 1, V, generator=g, dtype=torch.float64) * 2
        logp = torch.log_softmax(logits[0], -1)
        tokens = [int(torch.argmax(logp[i] + torch.rand(V, generator=g, dtype=torch.float64))) for i in range(k)]
        draft = Draft(tokens, None, [float(logp[i, t]) + rng.uniform(-1.5, 0.3) for i, t in enumerate(tokens)])
        verify = VerifyConfig("ratio", math.exp(rng.choice([0.0, 0.5])))
        key = rng.getrandbits(63)
        v = verify_batch(logits, [draft], torch.tensor([key]), [0], sampling, verify)[0]
        bonus = (int(v.emitted[-1]), float(v.logprobs[-1]))
        emitted, accepted, lps = verify_from_logprobs(
            "draft", draft, key, verify.lenience, draft_logprobs=[float(logp[i, t]) for i, t in enumerate(tokens)],
            bonus=bonus)
        assert accepted == v.num_accepted, trial
        if accepted < k:
            seen["rejected"] += 1
            assert emitted == v.emitted[:accepted]
        else:
            seen["full"] += 1
            assert emitted == v.emitted
        assert lps == pytest.approx(v.logprobs[:len(emitted)], abs=1e-9)
    assert seen["rejected"] and seen["full"]


def test_top1_scoring_decides_as_the_greedy_verifier():
    g = torch.Generator().manual_seed(1)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=64)
    for trial in range(100):
        k, V = 1 + trial % 5, 10
        logits = torch.randn(1, k + 1, V, generator=g, dtype=torch.float64)
        logp = torch.log_softmax(logits[0], -1)
        argmax = logp.argmax(-1).tolist()
        tokens = [a if (trial + i) % 3 else (a + 1) % V for i, a in enumerate(argmax[:k])]
        draft = Draft(tokens)
        v = verify_batch(logits, [draft], torch.tensor([trial]), [0], sampling, VerifyConfig())[0]
        top1 = [(a, float(logp[j, a])) for j, a in enumerate(argmax)]
        emitted, accepted, lps = verify_from_logprobs("top1", draft, trial, 1.0, top1=top1)
        assert (emitted, accepted) == (v.emitted, v.num_accepted)
        assert lps == pytest.approx(v.logprobs, abs=1e-9)


class _Echo(NullDrafter):
    """Proposes a fixed continuation after any output."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, key, output, budget):
        return Draft(self.tokens[len(output):len(output) + budget])


def test_the_vllm_proposer_cuts_and_counts_through_settle():
    """The proposer's per-step accounting (no vLLM needed) is the shared one: one pass per step,
    accepted draft tokens counted, cut at the stop token and at max_new_tokens."""
    key = RolloutKey("p", 0)
    session = vp.Session(_Echo([3, 4, 5, 6, 7, 8, 9, 2, 1]), stops={2}, k=3)
    state = vp.RowState(key, [], max_new_tokens=16)
    assert session.step(state, [3]) == [4, 5, 6]  # the prefill's token, then a draft of 3
    assert session.step(state, [4, 5, 0]) == [7, 8, 9]  # 2 accepted, then vLLM's own sample
    assert session.step(state, [7, 8, 2, 1]) == []  # 2 accepted, then the stop token: what follows is cut
    assert state.done and state.output == [3, 4, 5, 0, 7, 8, 2]
    c = state.counters
    assert (c.num_forward_passes, c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (3, 2, 6, 4)
    assert c.num_accepted_tokens_per_pos == [2, 2]

    short = vp.RowState(key, [], max_new_tokens=3)
    assert session.step(short, [3]) == [4]  # budget: 3 - 1 - 1 (room for the bonus)
    assert session.step(short, [4, 5]) == [] and short.done and short.output == [3, 4, 5]
    assert (short.counters.num_forward_passes, short.counters.num_accepted_tokens) == (2, 1)
