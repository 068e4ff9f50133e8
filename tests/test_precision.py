"""Honest low precision: margins, near-ties vs rule divergences in bf16, the greedy-rule check, and
the ratio rule's output distribution against bench.benchmarks.bias's formula."""
import math
from pathlib import Path

import hydra.utils
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

import bench.core.verify as verify_mod
from bench.core import precision
from bench.benchmarks.bias import rule_distribution
from bench.core.engine_protocol import Request
from bench.engines.torch.engine import TorchRefEngine
from bench.core.precision import classify, divergence_summary, near_tie_threshold
from bench.report.results import rollout_row
from bench.core.sampling import SamplingConfig, rollout_seed, uniform_reference
from bench.core.verify import VerifyConfig, check_rule, ratio_accept, verify_batch
from methods.base import Draft, RolloutKey
from methods.baseline import Baseline
from methods.oracle import OracleDrafter
from tiny_models import make_checkpoint

CONF = Path(__file__).resolve().parent.parent / "conf" / "method"
EXACT = ["baseline", "prefix_reuse_exact", "tree_cache", "tree_cache_tree", "history_spec", "suffix_global", "hybrid"]
# a 2,048-token random policy, sharpened and sampled cold enough that rollouts repeat across
# visits (so every history drafter gets drafts accepted) while bf16 still flips near-ties
SAMPLING = SamplingConfig(temperature=0.2, max_new_tokens=48)
PROMPTS = {f"p{i}": [0] + [3 + (11 * i + 5 * j) % 2000 for j in range(4 + i)] for i in range(4)}
STEPS = (1, 2, 3)


# ---------------------------------------------------------------- classify / divergence_summary

def test_classify_each_outcome():
    thr = 1e-3
    assert classify([5, 7, 9], [0.3, 0.2, 0.1], [5, 7, 9], [0.3, 0.2, 0.1], thr) == ("identical", None)
    assert classify([5, 7, 9], [], [5, 7, 9], [], thr) == ("identical", None)  # nothing to classify
    assert classify([5, 7, 2], [0.3, 4e-4, 0.2], [5, 8, 3], [0.3, 1e-4, 0.1], thr) == ("near_tie", 1)
    # u does not select the method's token by far more than a rounding shift: a wrong rule
    assert classify([5, 7], [0.3, -0.2], [5, 8], [0.3, 1e-4], thr) == ("rule_divergence", 1)
    # both tokens well inside their intervals: no rounding shift can swap them
    assert classify([5, 7], [0.3, 0.05], [5, 8], [0.3, 0.04], thr) == ("rule_divergence", 1)
    # one run's margin small is not enough: a genuine flip has both within the shift
    assert classify([5, 7], [0.3, 0.05], [5, 8], [0.3, 1e-5], thr) == ("rule_divergence", 1)
    assert classify([5, 7], [], [5, 8], [0.3, 1e-4], thr) == ("unknown", 1)
    assert classify([5, 7], None, [5, 8], None, thr) == ("unknown", 1)
    # one list a prefix of the other (a stop token flipped): the first position past the shorter
    assert classify([5, 1], [0.3, 2e-4], [5, 1, 4], [0.3, 0.2, 3e-4], thr) == ("near_tie", 2)


def test_divergence_summary_matches_slots_and_ignores_run_ahead():
    base = pd.DataFrame({"step": [1, 1, 1], "prompt_id": ["a", "b", "c"], "sample_idx": [0, 0, 0],
                         "output_tokens": [[1, 2], [3, 4], [5, 6]], "margins": [[.1, .1], [.1, 1e-4], [.1, .1]],
                         "run_ahead": [False] * 3})
    method = pd.DataFrame({"step": [1, 1, 1, 2], "prompt_id": ["c", "b", "a", "a"], "sample_idx": [0, 0, 0, 0],
                           "output_tokens": [[5, 9], [3, 5], [1, 2], [7]],
                           "margins": [[.1, -.3], [.1, 1e-4], [.1, .1], [.1]],
                           "run_ahead": [False, False, False, True]})
    s = divergence_summary(method, base, 1e-3)
    assert s == {"compared": 3, "identity_rate": pytest.approx(1 / 3), "near_ties": 1, "rule_divergences": 1}
    no_margins = divergence_summary(method.drop(columns="margins"), base, 1e-3)
    assert no_margins["compared"] == 3 and no_margins["near_ties"] is None and no_margins["rule_divergences"] is None
    same = divergence_summary(base.drop(columns="margins"), base.drop(columns="margins"), 1e-3)
    assert same == {"compared": 3, "identity_rate": 1.0, "near_ties": 0, "rule_divergences": 0}


def test_thresholds_are_ordered_by_precision():
    t = [near_tie_threshold(d) for d in ("float64", "float32", "float16", "bfloat16")]
    assert t == sorted(t) and near_tie_threshold("torch.bfloat16") == t[-1]
    with pytest.raises(ValueError, match="int8"):
        near_tie_threshold("int8")


# ---------------------------------------------------------------- margins in verify_batch

def _key():
    return rollout_seed(0, 1, "p", 0)


def test_margins_are_the_signed_distance_of_u_to_the_token_interval():
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 6, dtype=torch.float64)
    key = _key()
    v = verify_batch(logits, [Draft([1, 2, 3])], torch.tensor([key]), [5], SamplingConfig(), VerifyConfig())[0]
    probs = torch.softmax(logits[0], -1)
    for i, (tok, node) in enumerate(zip(v.emitted, v.path)):
        u = uniform_reference(key, 5 + node)
        cdf = torch.cumsum(probs[node], 0).tolist()
        lo = cdf[tok - 1] if tok else 0.0
        assert v.margins[i] == pytest.approx(min(u - lo, cdf[tok] - u), abs=1e-12)
        assert v.margins[i] > 0  # the exact rule emits only tokens u selects
    # greedy: top-1 minus top-2 probability for the argmax
    g = verify_batch(logits, [Draft([])], torch.tensor([key]), [5], SamplingConfig(temperature=0), VerifyConfig())[0]
    top = torch.softmax(logits[0, 0], -1).topk(2).values
    assert g.margins == [pytest.approx(float(top[0] - top[1]))]


def test_ratio_rule_margins_go_negative_on_tokens_u_does_not_select():
    # the draft token has tiny target mass but the same draft logprob: l * p / q = 1 -> always accepted
    logits = torch.tensor([[[0.0, 8.0, 8.0], [0.0, 8.0, 8.0]]], dtype=torch.float64)
    p0 = torch.softmax(logits[0, 0], -1)[0].item()
    d = Draft([0], logprobs=[math.log(p0)])
    v = verify_batch(logits, [d], torch.tensor([_key()]), [0], SamplingConfig(), VerifyConfig("ratio", 1.0))[0]
    assert v.emitted[0] == 0 and v.num_accepted == 1
    u = uniform_reference(_key(), 0)
    assert u > 2 * p0  # u lies outside token 0's interval [0, p0): the margin is p0 - u < 0
    assert v.margins[0] == pytest.approx(p0 - u, abs=1e-12)
    assert v.margins[1] > 0  # the bonus is a plain sample


def test_low_precision_logits_are_read_in_fp32():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 50).to(torch.bfloat16)
    drafts, keys = [Draft([4, 5]), Draft([7])], torch.tensor([_key(), rollout_seed(0, 1, "q", 1)])
    low = verify_batch(logits, drafts, keys, [0, 3], SamplingConfig(), VerifyConfig())
    high = verify_batch(logits.float(), drafts, keys, [0, 3], SamplingConfig(), VerifyConfig())
    assert [(v.emitted, v.logprobs, v.margins) for v in low] == [(v.emitted, v.logprobs, v.margins) for v in high]


# ---------------------------------------------------------------- the greedy rule needs temperature 0

def test_greedy_rule_at_positive_temperature_is_refused(tmp_path):
    check_rule(VerifyConfig("greedy"), SamplingConfig(temperature=0))
    check_rule(VerifyConfig("exact"), SamplingConfig(temperature=0.7))
    with pytest.raises(ValueError, match=r"sampling.temperature=0 .* or use verify.rule=exact") as err:
        check_rule(VerifyConfig("greedy"), SamplingConfig(temperature=0.7))
    assert "\n" not in str(err.value)
    eng = TorchRefEngine(dtype="float64")
    eng.load(make_checkpoint(tmp_path / "ck"))
    with pytest.raises(ValueError, match="verify.rule=greedy"):
        eng.rollout([Request(RolloutKey("p", 0), [0, 3])], SamplingConfig(), Baseline(), VerifyConfig("greedy"))


# ---------------------------------------------------------------- ratio rule vs bench.benchmarks.bias's formula

def test_ratio_accept_output_distribution_is_bias_formula():
    q = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05], dtype=torch.float64)
    p = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2], dtype=torch.float64)
    lenience, n = math.exp(0.5), 60_000
    g = torch.Generator().manual_seed(0)
    xs = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    ys = torch.multinomial(p, n, replacement=True, generator=g).tolist()
    us = torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-300).tolist()
    logq, logp = q.log().tolist(), p.log().tolist()
    counts = [0] * len(p)
    for x, y, u in zip(xs, ys, us):
        emitted, _ = ratio_accept(Draft([x], logprobs=[logq[x]]), [y, 0], [u], [logp[x]], lenience)
        counts[emitted[0]] += 1
    obs = torch.tensor(counts, dtype=torch.float64)

    def chi2(r):
        return float(((obs - n * r) ** 2 / (n * r)).sum())

    crit = 23.5  # chi-square, 4 degrees of freedom, p = 1e-4
    assert chi2(rule_distribution(q, p, lenience)) < crit
    # the same test rejects every nearby wrong formula: lossless p, no lenience, no rejection mass
    accepted = torch.minimum(q, lenience * p)
    for wrong in (p, rule_distribution(q, p, 1.0), accepted / accepted.sum(), q):
        assert chi2(wrong) > 50 * crit


# ---------------------------------------------------------------- bf16: every exact method, end to end

@pytest.fixture(scope="module")
def bf16_engine(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("bf16") / "policy", vocab=2048, hidden=64, layers=2, scale=10.0)
    eng = TorchRefEngine(dtype="bfloat16")
    eng.load(ckpt)
    return eng


def _requests(step):
    return [Request(RolloutKey(p, s), toks, step) for p, toks in PROMPTS.items() for s in range(4)]


def _run(engine, make_drafter, verify=VerifyConfig()) -> pd.DataFrame:
    """Rollouts of every step (prompts revisited at each), one drafter across steps."""
    rows, drafter = [], None
    for step in STEPS:
        drafter = make_drafter(step, drafter)
        drafter.begin_step(step)
        rows += [rollout_row(r, method="m") for r in engine.rollout(_requests(step), SAMPLING, drafter, verify)]
    return pd.DataFrame(rows)


def _from_conf(name):
    return lambda step, prev: prev or hydra.utils.instantiate(OmegaConf.load(CONF / f"{name}.yaml").drafter)


@pytest.fixture(scope="module")
def bf16_baseline(bf16_engine):
    return _run(bf16_engine, _from_conf("baseline"))


def _oracle(base):
    def make(step, prev):
        b = base[base.step == step]
        return OracleDrafter({RolloutKey(p, int(s)): [int(t) for t in toks]
                              for p, s, toks in zip(b.prompt_id, b.sample_idx, b.output_tokens)})
    return make


def test_bf16_exact_methods_diverge_only_by_near_ties(bf16_engine, bf16_baseline):
    thr = near_tie_threshold("bfloat16")
    assert all(len(m) == len(t) for m, t in zip(bf16_baseline.margins, bf16_baseline.output_tokens))
    identity = {}
    for name in EXACT[1:] + ["oracle"]:
        rows = _run(bf16_engine, _oracle(bf16_baseline) if name == "oracle" else _from_conf(name))
        assert rows.num_accepted_tokens.sum() > 0, f"{name} never had a draft accepted: the test drafts nothing"
        s = divergence_summary(rows, bf16_baseline, thr)
        assert s["compared"] == len(STEPS) * 16
        assert s["rule_divergences"] == 0, f"{name}: {s}"
        identity[name] = s["identity_rate"]
    assert identity["oracle"] < 1, "bf16 near-ties must really occur (else the check proves nothing)"
    assert min(identity.values()) < 1


def test_a_wrong_rule_shows_as_rule_divergences(bf16_engine, bf16_baseline, monkeypatch):
    real = verify_mod.descend

    def accept_first_draft_token(sampled, draft):  # the bug: the first draft token skips the test
        if draft.token_ids:
            sampled = [draft.token_ids[0]] + list(sampled[1:])
        return real(sampled, draft)

    monkeypatch.setattr(verify_mod, "descend", accept_first_draft_token)
    rows = _run(bf16_engine, _from_conf("prefix_reuse_exact"))
    s = divergence_summary(rows, bf16_baseline, near_tie_threshold("bfloat16"))
    assert s["rule_divergences"] > 0, s
    # the wrongly accepted tokens carry negative margins (u does not select them)
    assert min(min(m) for m in rows.margins if len(m)) < -near_tie_threshold("bfloat16")


def test_float64_margins_are_positive_and_identity_holds(tmp_path):
    eng = TorchRefEngine(dtype="float64")
    eng.load(make_checkpoint(tmp_path / "ck", vocab=2048, hidden=32, layers=1, scale=10.0))
    small = lambda step: _requests(step)[:8]  # noqa: E731
    base = [rollout_row(r) for r in eng.rollout(small(1), SAMPLING, Baseline(), VerifyConfig())]
    fut = {RolloutKey(r["prompt_id"], r["sample_idx"]): r["output_tokens"] for r in base}
    orc = [rollout_row(r) for r in eng.rollout(small(1), SAMPLING, OracleDrafter(fut, 8), VerifyConfig())]
    assert sum(r["num_accepted_tokens"] for r in orc) > 0
    assert all(m > 0 for r in base + orc for m in r["margins"])
    s = divergence_summary(pd.DataFrame(orc), pd.DataFrame(base), precision.near_tie_threshold("float64"))
    assert s == {"compared": 8, "identity_rate": 1.0, "near_ties": 0, "rule_divergences": 0}


def test_bf16_fp32_head_follows_a_weight_swap(tmp_path):
    a = make_checkpoint(tmp_path / "a", seed=0)
    b = make_checkpoint(tmp_path / "b", seed=1)
    reqs = [Request(RolloutKey("p", i), [0, 3, 4], 1) for i in range(2)]
    eng = TorchRefEngine(dtype="bfloat16")
    eng.load(a)
    eng.rollout(reqs, SAMPLING, Baseline(), VerifyConfig())
    eng.load(b)  # same architecture: the weights are swapped in place, the fp32 output layer too
    fresh = TorchRefEngine(dtype="bfloat16")
    fresh.load(b)
    assert eng.model.get_output_embeddings()(torch.ones(1, 64, dtype=torch.bfloat16)).dtype == torch.float32
    got, want = (e.rollout(reqs, SAMPLING, Baseline(), VerifyConfig()) for e in (eng, fresh))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_the_near_tie_benchmark_measures_cdf_shifts():
    """bench.benchmarks near-ties on a small random policy: chain and tree rows per dtype, float64's
    shift far below its threshold, and every exact run free of rule divergences."""
    from bench.benchmarks.near_ties import near_tie_shift
    rows = near_tie_shift(dtypes=("float64", "float32"), vocab=64, hidden=32, layers=1, batch=2, new_tokens=8,
                          budget=4)
    assert [(r["dtype"], r["shape"]) for r in rows] == [("float64", "chain"), ("float64", "tree"),
                                                       ("float32", "chain"), ("float32", "tree")]
    assert all(r["positions"] > 0 for r in rows)
    assert all(r["shift_max"] < 1e-9 for r in rows if r["dtype"] == "float64")
    assert all(r.get("rule_divergences", 0) == 0 for r in rows)
